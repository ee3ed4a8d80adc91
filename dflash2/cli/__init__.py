"""Thin command-line front ends over the public Python API."""
