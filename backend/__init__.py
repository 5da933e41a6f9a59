import warnings

# cryptography 51 deprecates DSA and asyncssh (2.24.1) names its DSA classes when imported: a warning
# on every command that reaches SSH, about nothing a user can change (tests/test_cli.py's real process
# holds stderr to the command's own words).
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh\.")
