"""Evaluation harness: tasks, prompts, grading, failure classes and metrics.

Submodules are imported explicitly (``from vase.eval.tasks import load_task``) so that
importing this package stays cheap: grading pulls in sympy only when it is used.
"""
