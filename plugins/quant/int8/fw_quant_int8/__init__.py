"""fw-quant-int8: INT8 weights, and W8A8 with integer products."""
