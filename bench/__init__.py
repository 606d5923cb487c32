"""posenc's benchmark harness: every figure side by side with a physical floor of the same run.

``python -m bench`` (``make bench``) runs the full suite, ``python -m bench --quick``
(``make bench-quick``) a smaller one; both write ``bench/results/latest.{md,json,png}``.
See ``bench/README.md`` for what is measured and how.
"""
