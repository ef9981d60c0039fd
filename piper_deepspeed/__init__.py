"""DeepSpeed adapter: the ``"piper"`` config block and Piper's all-to-all inside DeepSpeed-MoE.

Not implemented yet (see the project's issue on the DeepSpeed adapter); importing this package
does nothing else.
"""
