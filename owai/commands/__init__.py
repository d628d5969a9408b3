"""CLI subcommands, one module per thesis method.

Every public module here defines `register(app)`; `owai.cli` discovers and calls them, so adding a
subcommand means adding a module and nothing in the core. Modules starting with `_` are helpers.
"""
