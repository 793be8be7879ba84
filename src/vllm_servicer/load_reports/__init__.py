"""Load reports for balancers (ORCA, gRFC A51), one concern a module.

- `report.py`: the engine's figures and the calls' rates as one ORCA
  `OrcaLoadReport`, cached and serialized (`LoadReporter`); no grpc, no vLLM.
- `engine_load.py`: the engine's figures as a report reads them
  (`EngineLoadReader`), every frontend process's merged.
- `stats_tap.py`: the engine's latest scheduler stats per rank
  (`SchedulerStatsTap`), which GetLoads reads too.

The reports leave two ways: in every engine call's trailer
(`interceptors/load_reports.py`) and on ORCA's out-of-band stream
(`servicer/orca.py`). Nothing is imported here, so that the interceptors
reach `report.py` without vLLM.
"""
