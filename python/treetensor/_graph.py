"""treevalue's ``graph`` / ``graphics`` for our trees (DI-treetensor parity): a
``graphviz.Digraph`` with one node per tree node and per leaf value, edges labelled by key.

The graph is built by the ``graphviz`` package (PyPI, pure Python: ``pip install graphviz`` or
``pip install treetensor[graph]``), imported on the first call; drawing it (``render``,
``pipe``) needs Graphviz's ``dot`` program, building it does not (DI-treetensor refuses to build
one without ``dot``: DESIGN.md §15).

Ids and labels follow treevalue's so that a graph reads the same: a tree node is
``node_<hex>`` labelled with its root's name and path (``t.b``), a value is
``value__<parent id>__<key>`` labelled by ``repr_gen`` (default: ``str``, ``repr`` for str), or
with ``dup_value`` ``value_<hex id>`` shared by equal ids. A node reached twice (one tree given
twice, or a subtree given beside its tree) is drawn once. The generators ``node_cfg_gen`` and
``edge_cfg_gen`` are called with as many of these positional arguments as they take:
``(current, parent, current_path, parent_path, is_node, is_root, root)`` for nodes and
``(current, parent, current_path, parent_path, is_node, root)`` for edges, ``root`` being
``(tree, name, index)``; ``repr_gen`` with ``(value, path)``; ``dup_value`` (a callable) with
``(value, parent, path, parent_path)``.
"""
import collections
import colorsys
import html
import inspect
import re

__all__ = ["graphics"]


def _digraph():
    try:
        from graphviz import Digraph
    except ImportError as e:
        raise ImportError("treetensor: graph() and graphics() build a graphviz.Digraph and need "
                          "the graphviz package (pip install graphviz)") from e
    return Digraph


def _arity_call(fn):
    """fn called with the first n positional arguments it takes (all of them for *args)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: give it everything
        return fn
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return fn
    n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    return lambda *args: fn(*args[:n])


def _escape(text):
    """A DOT label: HTML entities for markup characters and spaces (kept by every renderer),
    and a multi-line text as left-justified lines (each ended by \\l), as treevalue writes it."""
    lines = html.escape(str(text)).replace(" ", "&ensp;").split("\n")
    return lines[0] if len(lines) == 1 else "".join(line + "\\l" for line in lines)


def _flat_title(title):
    return re.sub(r"[^0-9a-z]+", "_", title.lower()).strip("_")


def _colors(index):
    """(line, key font, node border, value border, fill, text) RGBA for the index-th tree: hues
    spread by the golden ratio so that neighbouring trees differ."""
    hue = (0.36 + index * 0.618034) % 1.0

    def rgba(s, v, alpha):
        r, g, b = colorsys.hsv_to_rgb(hue, s, v)
        return "#%02x%02x%02x%02x" % (round(r * 255), round(g * 255), round(b * 255), round(alpha * 255))

    return (rgba(0.8, 0.6, 0.8), rgba(1.0, 0.45, 1.0), rgba(0.65, 0.7, 0.6), rgba(0.65, 0.7, 0.0),
            rgba(0.55, 1.0, 0.6), rgba(1.0, 0.2, 1.0))


def _value_repr(x, path):
    return repr(x) if isinstance(x, str) else str(x)


def _value_id_gen(dup_value):
    """(value, parent, parent's id, path, parent_path) -> the value's node id."""
    if not dup_value:
        return lambda v, parent, parent_id, path, parent_path: "value__%s__%s" % (parent_id, path[-1])
    if isinstance(dup_value, (type, tuple)):
        key = lambda v, *rest: id(v) if isinstance(v, dup_value) else None  # noqa: E731
    elif callable(dup_value):
        key = _arity_call(dup_value)
    else:
        key = lambda v, *rest: id(v)  # noqa: E731

    def value_id(v, parent, parent_id, path, parent_path):
        k = key(v, parent, path, parent_path)
        if not k:
            return "value__%s__%s" % (parent_id, path[-1])
        return "value_%x" % k if isinstance(k, int) else "value_%s" % k

    return value_id


def graphics(is_tree, node_id, *trees, title=None, cfg=None, dup_value=False, repr_gen=None,
             node_cfg_gen=None, edge_cfg_gen=None):
    """The graph of `trees` (each a tree or a ``(tree, name)`` pair). `is_tree(x)` says whether
    a child is a node; `node_id(node)` is an int naming a node (the same for views of one node).
    @raises ImportError without the graphviz package; TypeError for an argument that is not a
    tree (naming its position)."""
    roots = []
    for index, item in enumerate(trees):
        tree, name = item if isinstance(item, tuple) else (item, None)
        if not is_tree(tree):
            raise TypeError(f"graphics: argument {index} is a {type(tree).__name__}, not a tree "
                            f"(give trees or (tree, name) pairs)")
        name = "<%s #%x>" % (type(tree).__name__, node_id(tree)) if name is None else str(name)
        roots.append((tree, name, index))
    title = title or ""
    graph = _digraph()(name=_flat_title(title), comment=title)
    graph.graph_attr.update({k: v for k, v in (cfg or {}).items() if v is not None})
    graph.graph_attr["label"] = title
    represent = _arity_call(repr_gen) if repr_gen else _value_repr
    node_extra = _arity_call(node_cfg_gen) if node_cfg_gen else (lambda *a: {})
    edge_extra = _arity_call(edge_cfg_gen) if edge_cfg_gen else (lambda *a: {})
    value_id = _value_id_gen(dup_value)
    drawn, edges, queue = set(), set(), collections.deque()

    def node_style(color, is_node, is_root):
        line, key, border, value_border, fill, text = color
        return {"fillcolor": fill, "color": border if is_node else value_border, "fontcolor": text,
                "style": "filled", "penwidth": "3" if is_root else "1.5",
                "shape": "diamond" if is_root else ("ellipse" if is_node else "box"),
                "fontname": "monospace bold" if is_node else "monospace"}

    def attrs(style, extra):
        style.update({k: v for k, v in (extra or {}).items() if v is not None})
        return {k: str(v) for k, v in style.items()}

    for root in roots:
        tree, name, index = root
        rid = "node_%x" % node_id(tree)
        if rid not in drawn:
            drawn.add(rid)
            graph.node(rid, label=_escape(name), **attrs(
                node_style(_colors(index), True, True), node_extra(tree, None, [], [], True, True, root)))
            queue.append((rid, tree, root, []))
    while queue:
        parent_id, parent, root, parent_path = queue.popleft()
        line, key_font = _colors(root[2])[:2]
        for key, child in type(parent).items(parent):  # keys come before methods
            path = [*parent_path, key]
            is_node = is_tree(child)
            cid = "node_%x" % node_id(child) if is_node else value_id(child, parent, parent_id, path, parent_path)
            if cid not in drawn:
                drawn.add(cid)
                label = ".".join([root[1], *map(str, path)]) if is_node else represent(child, path)
                graph.node(cid, label=_escape(label), **attrs(
                    node_style(_colors(root[2]), is_node, False),
                    node_extra(child, parent, path, parent_path, is_node, False, root)))
                if is_node:
                    queue.append((cid, child, root, path))
            if (parent_id, cid, key) not in edges:
                edges.add((parent_id, cid, key))
                graph.edge(parent_id, cid, label=_escape(key), **attrs(
                    {"arrowhead": "vee" if is_node else "dot", "arrowsize": "1.0" if is_node else "0.5",
                     "color": line, "fontcolor": key_font, "fontname": "Times-Roman bold"},
                    edge_extra(child, parent, path, parent_path, is_node, root)))
    return graph
