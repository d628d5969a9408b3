"""Evaluations shared by methods and `owai eval`: language-model losses, attention, continuations."""
