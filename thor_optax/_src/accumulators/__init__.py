"""Factor accumulators, one module each: ``current_batch`` (THOR, SKFAC) and
``running_average`` (K-FAC, KAISA, SP-NGD); the interface is ``base.FactorAccumulator``."""
