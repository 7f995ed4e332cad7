"""``mode=profile``: measure the machine at hand into a hardware profile (docs/profile.md).

The ranks a run would use (``tp x pcp``, started as a run's are: ``pcpflow.driver.launch``,
``pcpflow.rank.bootstrap``) measure, all at once, over grids that depend on no model
(``grid``): op launch, memory streaming, GEMMs by shape, attention by shape through the run's
backend, pcpflow's own per-step host work, and every collective of the grid by message size
(``sections``). Rank 0 writes ``<run dir>/hardware.yaml`` after every section (``document``):
a valid hardware profile with a ``tables:`` section, "partial" until the last one is done.
``pcpflow.simulate.measured`` prices on it.
"""
