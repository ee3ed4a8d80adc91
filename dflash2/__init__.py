"""dflash2: DFlash / DFlash2 speculative decoding from checkpoint to TensorRT / ONNX Runtime.

Importing the package imports neither torch nor transformers: the runtime runs on edge boards.
"""

__version__ = "0.1.0"
