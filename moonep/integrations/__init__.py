"""Drop-in integrations with training stacks: ``moonep.integrations.hf`` (transformers 5.x MoE models) and
``moonep.integrations.torchtitan`` (torchtitan 0.3's ``RoutedExperts`` seam). Each imports its framework only
when used; see moonep/README.md, "Integrations"."""
