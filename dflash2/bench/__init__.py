"""Measurement: benches, schedule replay, the scale check and studies, over what ships. Nothing that ships
imports this package (tests/test_stages.py); the CLIs and scripts/ do."""
