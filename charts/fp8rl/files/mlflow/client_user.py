"""Creates (or updates the password of) the MLflow user the pipeline steps and Ray pods log as, before the server
starts: a user without admin rights, who owns the experiments it creates and reads the others
(``default_permission``).  Runs in the MLflow server's image with only MLflow: the auth database is the one
``MLFLOW_AUTH_CONFIG_PATH`` names; the user and password come from ``FP8RL_MLFLOW_CLIENT_USERNAME`` and
``FP8RL_MLFLOW_CLIENT_PASSWORD`` (the chart's client Secret)."""

import os
import sys

from mlflow.server.auth.config import read_auth_config
from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore


def main() -> int:
    username = os.environ.get("FP8RL_MLFLOW_CLIENT_USERNAME", "")
    password = os.environ.get("FP8RL_MLFLOW_CLIENT_PASSWORD", "")
    config = read_auth_config()
    if not username or not password:
        print("FP8RL_MLFLOW_CLIENT_USERNAME and FP8RL_MLFLOW_CLIENT_PASSWORD must be set", file=sys.stderr)
        return 2
    if username == config.admin_username:
        print(f"the client user {username!r} is the admin user: give it a name of its own", file=sys.stderr)
        return 2
    store = SqlAlchemyStore()
    store.init_db(config.database_uri)
    if store.has_user(username):
        store.update_user(username, password=password, is_admin=False)
        print(f"MLflow user {username!r}: password set, not an admin")
    else:
        store.create_user(username, password, is_admin=False)
        print(f"MLflow user {username!r} created (not an admin)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
