"""Analytical models of the spec, labeled analytical, not used by the serving path.

Nothing here runs when the runtime serves a step: these modules model the spec's arithmetic and check it
against its fixtures (tests) and against measurements (benchmarks). Every number they compute carries
``evidence = "analytical"`` unless it was measured (``overlapped_layer``'s timeline says ``"measured"``).

* ledgers: ``ledger_base`` (evidence label, widths, shared checks), ``byte_ledgers`` (row slots, payload,
  transport, padding: 0x03C1, 0x03D1, 0x03D2, 0x03D6), ``lifetime_ledger`` (buffer lifetimes and safe
  release: 0x03D3-0x03D5), ``precision_ledger`` (FP8 payload, runner alignment: 0x0AB, 0x0AD),
  ``step_ledger`` (the baseline step's buffers and events, ``StepLedger``, ``ledger_from_handles``);
* overlap schedule model: ``overlap_schedule`` (tasks, streams, serialized vs overlapped schedules,
  buffer lifetimes: 0x09-0x09F); ``overlapped_layer`` + ``overlapped_streams`` execute that DAG with
  chunks on streams and events and validate the measured timeline against it (tests and
  ``bench/overlap.py`` only);
* phase split model: ``phase_split`` (phase profiles, unit plans, mixed-batch split: 0x05A-0x05F),
  ``execution_ledger`` (row/unit ledgers of the variable path, of a bucket replay and of a fallback),
  ``bucket_inputs`` (padded decode-bucket inputs, mask state, staging into stable buffers: 0x05C);
* placement builder/objective: ``placement_builder`` (manifests and the ideal-load objective from EPLB
  output: 0x08C3, 0x08D).

Import direction: this package imports the runtime packages (``dispatch``, ``phases``, ``placement``,
``experts``, ``types``, ``errors``); none of them imports it, except ``release/service.py``, which binds
the overlap schedule model to a release.
"""
