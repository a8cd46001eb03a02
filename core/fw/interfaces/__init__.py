"""One interface module per plugin kind: the abstract class and its capability record."""
