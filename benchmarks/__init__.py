"""Benchmark results: `record` writes one JSON file per benchmark run into `results/`,
`report` renders the latest of each into docs/benchmarks.md. Standard library only: both run in
nox's own interpreter, where no EStream package is installed."""
