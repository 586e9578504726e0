"""Timings behind ``fedlora bench``: each module measures A against B interleaved on one machine
and reports ratios (``harness``, ``ratios``, ``readme`` are the shared parts).
"""
