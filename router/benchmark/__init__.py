"""Serving benchmark client (`pdserve-bench-serving`): datasets, a grpc.aio runner, vLLM-convention metrics, plots.

datasets builds request specs, runner sends them and records every response's time, metrics turns the
records into vLLM's figures, plots draws them, cli ties it together.
"""
