"""The device check (scripts/device_check.sh, python -m dflash2.bench.device, dflash2-plugins device):
everything that runs on a GPU machine without TensorRT, as one command; docs/gpu.md. Measurement, so a
bench-stage package (it runs the PyTorch references and the trainer), split by job:
  runner.py    rows, budgets, the table / JSON / verdict, --travel
  kernel.py    the kernel-only build, kernel vs twin cases and rule, kernel microseconds
  graph.py     CUDA-graph capture / replay through cuda-bindings
  families.py  the PyTorch references GPU vs CPU
  trainer.py   the trainer run, the skipped tensorrt row
  main.py      the environment piece, the refusal, the piece table, main
Importing this package loads none of them."""
