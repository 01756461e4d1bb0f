"""MoonEP: perfectly balanced expert-parallel dispatch/combine for MoE training.

The EP layer itself (``Buffer``, ``MoE``) lands with its own issue; this package already owns the ``moonep``
command line (``moonep.cli``).
"""
__version__ = "0.1.0"
