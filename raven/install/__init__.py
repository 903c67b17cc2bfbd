"""``raven install``'s work: the answers (answers.py), the kustomization rendered from the shipped manifests
(render.py) and the secret material kept in files (secrets.py). The command line is raven/cli/install.py.
"""
