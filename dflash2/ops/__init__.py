"""Custom operators: one contract (contract.py) that the torch op, the ONNX schema and the
TensorRT plugin are all checked against."""
