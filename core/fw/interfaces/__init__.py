"""The plugin contracts: one module per plugin kind (the abstract class and its capability record), the hooks, and
a plugin's declaration (``spec``). A leaf: nothing here imports fw beyond ``fw.interfaces`` and ``fw.sdk``."""
