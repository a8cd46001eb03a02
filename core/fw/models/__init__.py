"""Built-in model architectures (each registered as an ``fw.models`` plugin in ``fw.models.specs``)."""
