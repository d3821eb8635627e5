package migrations

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"log/slog"
	"regexp"
	"sort"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// fifobox's objects live in their own schema (pkg/db.SearchPath puts it
// first in every connection's search_path), so a user's table named outbox
// is never shadowed. Releases before issue 29 installed into the
// connection's default schema (usually public). prepareSchema runs before
// goose: it creates the target schema and, when the target holds no
// fifobox_schema_version but a schema later in the search_path does, moves
// fifobox's objects from there in one transaction. It must run before any
// migration: goose would otherwise find the old version table through the
// search_path and apply new migrations into the empty schema.

// createdName matches every object a migration creates, including the ones
// a DO block creates with format('CREATE FUNCTION %I.name', ...).
var createdName = regexp.MustCompile(`(?i)create\s+(?:or\s+replace\s+)?(?:unlogged\s+)?(?:table|view|materialized\s+view|function|procedure|sequence|type|domain)\s+(?:if\s+not\s+exists\s+)?(?:%I\.)?"?([a-z_][a-z0-9_]*)`)

// notMoved are names a migration created that are not fifobox's: 00003's
// demo read model, which 00051 leaves where it is when it holds the user's
// rows.
var notMoved = map[string]bool{"orders_read_model": true}

// versionTable is goose's table, in fifobox's schema.
const versionTable = "fifobox_schema_version"

// ObjectNames returns the names of the objects fifobox's migrations create
// (tables, views, sequences, functions, types), plus goose's version table:
// what an upgrade moves. Capture's trigger functions (fifobox_capture_*,
// pkg/capture) are moved too, by prefix.
func ObjectNames() ([]string, error) {
	seen := map[string]bool{versionTable: true}
	err := fs.WalkDir(files, ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := files.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range createdName.FindAllStringSubmatch(string(b), -1) {
			if n := strings.ToLower(m[1]); !notMoved[n] {
				seen[n] = true
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(seen))
	for n := range seen {
		names = append(names, n)
	}
	sort.Strings(names)
	return names, nil
}

// targetSchema is the first schema of the connection's search_path: where
// fifobox is (to be) installed. A path that starts with "$user" (a server
// default) falls back to current_schema(), the old behaviour.
func targetSchema(ctx context.Context, tx pgx.Tx) (string, error) {
	var path string
	var current *string
	if err := tx.QueryRow(ctx, `SELECT current_setting('search_path'), current_schema()`).Scan(&path, &current); err != nil {
		return "", fmt.Errorf("read search_path: %w", err)
	}
	if first := firstPathElement(path); first != "" && first != "$user" {
		return first, nil
	}
	if current == nil {
		return "", fmt.Errorf("search_path %q names no existing schema: set FIFOBOX_SCHEMA", path)
	}
	return *current, nil
}

// firstPathElement returns the first schema named by a search_path setting,
// unquoted ("" when the path is empty).
func firstPathElement(path string) string {
	path = strings.TrimSpace(path)
	if strings.HasPrefix(path, `"`) {
		var b strings.Builder
		for i := 1; i < len(path); i++ {
			if path[i] == '"' {
				if i+1 < len(path) && path[i+1] == '"' {
					b.WriteByte('"')
					i++
					continue
				}
				return b.String()
			}
			b.WriteByte(path[i])
		}
		return b.String()
	}
	first, _, _ := strings.Cut(path, ",")
	return strings.ToLower(strings.TrimSpace(first))
}

// prepareSchema creates the target schema if missing and moves an older
// install into it (see above). It returns the target schema.
func prepareSchema(ctx context.Context, pool *pgxpool.Pool) (string, error) {
	var target string
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		if target, err = targetSchema(ctx, tx); err != nil {
			return err
		}
		h := fnv.New64a()
		h.Write([]byte("fifobox-prepare:" + target))
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(h.Sum64()>>1)); err != nil {
			return fmt.Errorf("lock: %w", err)
		}
		var exists, installed bool
		if err := tx.QueryRow(ctx, `SELECT to_regnamespace($1) IS NOT NULL,
			    EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
			            WHERE n.nspname = $1 AND c.relname = $2)`, target, versionTable).Scan(&exists, &installed); err != nil {
			return fmt.Errorf("look up schema %s: %w", target, err)
		}
		if installed {
			return nil
		}
		if !exists {
			// Checked first: CREATE SCHEMA IF NOT EXISTS needs the right to
			// create schemas even when the schema is there.
			if _, err := tx.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{target}.Sanitize()); err != nil {
				return fmt.Errorf("create schema %s: %w", target, err)
			}
		}
		// An older install: the first schema after the target in the
		// search_path that holds goose's table (what current_schema() was
		// before the target existed).
		var old *string
		if err := tx.QueryRow(ctx, `SELECT s FROM unnest(current_schemas(false)) WITH ORDINALITY AS p(s, i)
			WHERE s <> $1 AND EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
			                          WHERE n.nspname = p.s AND c.relname = $2)
			ORDER BY i LIMIT 1`, target, versionTable).Scan(&old); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("look for an earlier install: %w", err)
		}
		if old == nil {
			return nil
		}
		slog.InfoContext(ctx, "moving fifobox's objects into their schema", "from", *old, "to", target)
		return moveObjects(ctx, tx, *old, target)
	})
	if err != nil {
		return "", fmt.Errorf("migrate: prepare schema: %w", err)
	}
	return target, nil
}

// moveObjects moves fifobox's objects (ObjectNames) from schema from to
// schema to, inside tx. Indexes, triggers, constraints, owned sequences and
// row types move with their tables; views, triggers and column defaults
// refer to objects by OID, so they keep working. What names the schema in
// text is fixed: the search_path pinned on functions (00038, 00052,
// capture's trigger functions) and the roles' USAGE on the schema (00011).
func moveObjects(ctx context.Context, tx pgx.Tx, from, to string) error {
	names, err := ObjectNames()
	if err != nil {
		return err
	}
	// Each statement names its object fully, built before anything moves.
	rows, err := tx.Query(ctx, `
		SELECT format('ALTER ROUTINE %I.%I(%s) SET SCHEMA %I', n.nspname, p.proname,
		              pg_get_function_identity_arguments(p.oid), $3::text)
		FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
		WHERE n.nspname = $1 AND (p.proname = ANY($2) OR p.proname LIKE 'fifobox\_capture\_%')
		UNION ALL
		SELECT format('ALTER %s %I.%I SET SCHEMA %I',
		              CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
		                             WHEN 'S' THEN 'SEQUENCE' WHEN 'f' THEN 'FOREIGN TABLE' ELSE 'TABLE' END,
		              n.nspname, c.relname, $3::text)
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relname = ANY($2) AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
		  -- A serial's or identity's sequence moves with its table; a
		  -- partition (00064's wake-up slots) does not move with its parent,
		  -- and a partitioned table depends on itself (its partition key).
		  AND (c.relispartition OR NOT EXISTS (SELECT 1 FROM pg_depend d
		                  WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.refobjid <> c.oid
		                    AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')))
		UNION ALL
		SELECT format('ALTER %s %I.%I SET SCHEMA %I', CASE t.typtype WHEN 'd' THEN 'DOMAIN' ELSE 'TYPE' END,
		              n.nspname, t.typname, $3::text)
		FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
		WHERE n.nspname = $1 AND t.typname = ANY($2) AND t.typtype IN ('e', 'd', 'r')
		   OR (n.nspname = $1 AND t.typname = ANY($2) AND t.typtype = 'c'
		       AND (SELECT relkind FROM pg_class WHERE oid = t.typrelid) = 'c')`, from, names, to)
	if err != nil {
		return fmt.Errorf("list objects in %s: %w", from, err)
	}
	stmts, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("list objects in %s: %w", from, err)
	}
	for _, s := range stmts {
		if _, err := tx.Exec(ctx, s); err != nil {
			return fmt.Errorf("%s: %w", s, err)
		}
	}
	// Functions pinned to the old schema by name.
	rows, err = tx.Query(ctx, `
		SELECT format('%I.%I(%s)', n.nspname, p.proname, pg_get_function_identity_arguments(p.oid)), substr(cfg, 13)
		FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace, unnest(p.proconfig) AS cfg
		WHERE n.nspname = $1 AND cfg LIKE 'search\_path=%'`, to)
	if err != nil {
		return fmt.Errorf("list pinned functions: %w", err)
	}
	type pinned struct{ fn, path string }
	pins, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (pinned, error) {
		var p pinned
		return p, r.Scan(&p.fn, &p.path)
	})
	if err != nil {
		return fmt.Errorf("list pinned functions: %w", err)
	}
	for _, p := range pins {
		path, changed := repath(p.path, from, to)
		if !changed {
			continue
		}
		if _, err := tx.Exec(ctx, fmt.Sprintf("ALTER ROUTINE %s SET search_path = %s", p.fn, path)); err != nil {
			return fmt.Errorf("re-pin %s: %w", p.fn, err)
		}
	}
	// fifobox's roles (00011) reach their tables through the schema.
	if _, err := tx.Exec(ctx, fmt.Sprintf(`DO $grant$
DECLARE r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['fifobox_producer', 'fifobox_dispatcher', 'fifobox_consumer', 'fifobox_operations'] LOOP
        IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) AND has_schema_privilege(r, %[1]s, 'USAGE') THEN
            EXECUTE format('GRANT USAGE ON SCHEMA %%I TO %%I', %[2]s, r);
        END IF;
    END LOOP;
END
$grant$`, quoteLiteral(from), quoteLiteral(to))); err != nil {
		return fmt.Errorf("grant usage on %s: %w", to, err)
	}
	return nil
}

// repath replaces schema from by schema to in a search_path setting.
func repath(path, from, to string) (string, bool) {
	parts := strings.Split(path, ",")
	changed := false
	for i, p := range parts {
		if firstPathElement(p) == from {
			parts[i] = pgx.Identifier{to}.Sanitize()
			changed = true
			continue
		}
		parts[i] = strings.TrimSpace(p)
	}
	return strings.Join(parts, ", "), changed
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
