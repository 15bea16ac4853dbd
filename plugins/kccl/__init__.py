"""kccl: Kog's CPU collectives. Ranks on one machine exchange lane partials through the
`Collective.all_gather` interface: `cpu_threads` (ranks are threads of one process) and
`cpu_processes` (ranks are processes sharing a memory segment). `run_ranks` drives R
reference backends, one a rank."""
