"""Predicting the degradation boundary before a sweep measures it (`tierguard predict`).

calibrate.py   probe runs against the real server, fitted and cached by fingerprint
costmodel.py   step time by step shape (regimes, relative NNLS, residual noise)
media.py       KV tier transfer times, measured with the real tier code
engines.py     which engine a variant runs; black-box engines' batching policy
simengine.py   the real LLMEngine on a simulated clock, its mechanism replaced
workload.py    a cell's requests as the bench plans them
driver.py      the discrete-event loop: bench client + engine thread
predictor.py   the sweep's search over simulated cells, in the sweep's layout
"""
