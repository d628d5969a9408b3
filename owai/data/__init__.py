"""Datasets: the catalogue (`owai.data.registry`) and the modules that read each dataset.

Every loader registers its datasets with the registry, which imports none of them. This file runs
before any module of the package, and it imports every loader, so wherever the registry is used the
catalogue is complete, whatever was imported first. The order below is the order of `owai data list`.
"""

from owai.data import mnist, camelyon17, domainbed, text, classification  # noqa: F401,I001 - each registers its datasets
