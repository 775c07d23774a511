"""Sweeps: run one identical load profile against a matrix of engine variants and find,
for each variant and context length, the highest concurrency at which every SLO holds.

matrix.py       the matrix file (YAML), validated at the edge
lifecycle.py    start an engine, wait for health, warm it up, stop it
benchcall.py    one `tierguard bench` run per cell, as a subprocess
results.py      read a bench result directory; stats.py: p99 + bootstrap interval
cells.py        a cell's verdict against the SLOs; boundary.py: ladder + bisection
fingerprints.py refuse to compare runs whose workload profiles differ
runner.py       the resumable sweep; environment.py: host and topology
demo.py         the demo matrix (data/demo.yaml), trimmed to the flags this build has
"""
