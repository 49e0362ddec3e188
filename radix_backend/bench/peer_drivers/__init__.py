"""Stand-alone drivers that run one system on `bench peers`' prompt file, each in its own process
and its own venv: they import nothing of radix_backend (the peers' venvs do not have it), only
`driver_protocol` beside them, which the scripts find as their own directory is on sys.path."""
