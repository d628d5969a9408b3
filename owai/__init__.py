"""owai: the learning principles of *AI for the Open-World* (J. Zhang, NYU 2025), runnable.

Data flows cli -> recipe -> method -> model zoo / data -> training loop -> results.
See docs/architecture.md.
"""

__version__ = "0.1.0"
