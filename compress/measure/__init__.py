"""Evaluation: perplexity / KL / top-1 (ppl.py), memory (memory.py), speed (speed.py), the report (report.py)."""
