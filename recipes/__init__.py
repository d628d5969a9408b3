"""Packaged recipes (installed as `owai.recipe_files`): one YAML file per thesis table or figure."""
