"""Runnable entry points: training jobs and benchmarks."""
