"""Engines stage: an export folder -> TensorRT engines + an engine-folder manifest (dflash2-build),
and Polygraphy comparisons of every graph against the PyTorch reference (dflash2-compare).

Pure planning (profiles, trtexec lines, manifest) imports neither tensorrt nor torch; only
`dflash2.engines.build` needs TensorRT, and only when it actually builds.
"""
