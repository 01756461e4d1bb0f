"""Drop-in adapters for code written against other EP libraries: ``moonep.compat.deepep.Buffer``."""
