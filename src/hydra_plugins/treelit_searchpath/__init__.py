"""Hydra search-path plugin: config groups shipped by treelit plugins become composable.

A plugin package declares an entry point in the group ``treelit.conf`` whose value is
the importable package holding its config tree (e.g. ``treelit_example.conf``); its
files then extend treelit's groups (``objective=my_objective``) with no change to
treelit.
"""

from importlib.metadata import entry_points

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class TreelitPluginSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for ep in entry_points(group="treelit.conf"):
            search_path.append(provider=f"treelit-plugin-{ep.name}", path=f"pkg://{ep.value}")
