"""The whole pipeline (`fedlora run`): train, analyze, attack, audit, report; above the
other packages, which never import it."""
