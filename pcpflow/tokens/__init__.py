"""Tokens in and out: ``text`` (tokenizers, chats, EOS ids), ``sampling`` (keyed draws),
``stopping`` (stop tokens).
"""
