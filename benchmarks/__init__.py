"""Benchmarks: scripts that print figures and write JSON reports (never timed tests).

python -m benchmarks.offline      ours (in-process and through the gateway) vs HF generate
python -m benchmarks.online       OpenAI-API load generator: TTFT, TPOT, ITL, goodput, plots
python -m benchmarks.overhead     control-plane cost per step against an instant compute plane
"""
