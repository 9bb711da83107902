"""The run directory on disk: identity, lock and metrics (``rundir``), the checkpoint format (``checkpoint``),
sample grids and curves (``pictures``) and the HTML report (``report``)."""
