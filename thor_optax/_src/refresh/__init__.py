"""Refresh policies, one module each: ``every_check`` (K-FAC), ``trace_rule`` (THOR's trace
mask), ``adaptive`` (SP-NGD); the interface is ``base.RefreshPolicy``."""
