"""What training needs: params, data sources and splits, the tokenize stage, train, evaluate,
MLflow tracking, promotion and the `lmops` command. Uses lmops.runtime, never the reverse.
"""
