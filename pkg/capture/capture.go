// Package capture lets a system's producers keep writing their own outbox
// table, as their design has it, while fifobox delivers those rows: a
// profile's source section (pkg/wire) says where each event field is in a
// row, and Check verifies that against the database before anything is
// installed, naming the profile field at fault.
package capture

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/wire"
)

// DB is what Check reads the catalog through (a pool, a connection or a
// transaction).
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Table is the producers' table as the catalog describes it.
type Table struct {
	OID    uint32
	Schema string
	Name   string
	// Columns maps each column to its type (format_type: "uuid", "text",
	// "character varying(26)", "jsonb", "timestamp with time zone"...).
	Columns map[string]string
}

// Ident is the table's schema-qualified, quoted name.
func (t Table) Ident() string { return pgx.Identifier{t.Schema, t.Name}.Sanitize() }

// ErrSource is wrapped by every problem Check finds.
var ErrSource = errors.New("capture: the profile's source does not match the database")

// Check verifies p's source against the database: the table exists; every
// column a field names exists, with a type that can hold it (a json
// member needs a json or jsonb column; the event id a uuid or text
// column); and an event id held in a column is unique (its primary key, or
// a unique index on it alone), so no producer's insert that succeeds today
// would fail on fifobox's unique event id tomorrow. Every problem is
// reported at once, each naming its profile field.
func Check(ctx context.Context, db DB, p *wire.Profile) (Table, error) {
	s := p.Source
	if s == nil {
		return Table{}, fmt.Errorf("profile %s: no source section", p.Name)
	}
	t, err := describe(ctx, db, s.Table)
	if err != nil {
		return Table{}, fmt.Errorf("profile %s: source.table: %w", p.Name, err)
	}
	var errs []error
	add := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: profile %s: source.%s: %s", ErrSource, p.Name, field, fmt.Sprintf(format, args...)))
	}
	refs := s.Refs()
	names := make([]string, 0, len(refs))
	for f := range refs {
		names = append(names, f)
	}
	sort.Strings(names)
	for _, f := range names {
		for _, r := range refs[f] {
			typ, ok := t.Columns[r.Column]
			switch {
			case !ok:
				add(f, "table %s has no column %q (it has %s)", t.Ident(), r.Column, t.columnList())
			case len(r.Path) > 0 && typ != "json" && typ != "jsonb":
				add(f, "%s: column %q is %s, not json or jsonb: it has no members", r, r.Column, typ)
			}
		}
	}
	if id := refs["event_id"]; len(id) > 0 {
		switch r := id[0]; {
		case len(id) > 1:
			add("event_id", "%q: one column or json member (the event id has no alternatives)", s.EventID)
		case len(r.Path) == 0:
			typ, ok := t.Columns[r.Column]
			if ok && typ != "uuid" && typ != "text" && !strings.HasPrefix(typ, "character") {
				add("event_id", "column %q is %s: a uuid column, or text holding a %s", r.Column, typ, strings.ToUpper(string(p.EventIDFormat)))
			}
			if ok && p.EventIDFormat == wire.ULID && typ == "uuid" {
				add("event_id", "column %q is a uuid, but event_id_format is ulid", r.Column)
			}
			if ok {
				unique, err := uniqueColumn(ctx, db, t.OID, r.Column)
				if err != nil {
					return t, fmt.Errorf("profile %s: source.event_id: %w", p.Name, err)
				}
				if !unique {
					add("event_id", "column %s.%q is not unique (no primary key or unique index on it alone): a second row with the same id would be a second event", t.Ident(), r.Column)
				}
			}
		}
	}
	for _, state := range []string{"sent", "dead"} {
		for _, set := range s.StatusSets(state) {
			r := set.Target
			typ, ok := t.Columns[r.Column]
			switch {
			case !ok:
				add(fmt.Sprintf("status.%s[%q]", state, r), "table %s has no column %q (it has %s)", t.Ident(), r.Column, t.columnList())
			case len(r.Path) > 0 && typ != "json" && typ != "jsonb":
				add(fmt.Sprintf("status.%s[%q]", state, r), "column %q is %s, not json or jsonb: it has no members", r.Column, typ)
			}
		}
	}
	for _, c := range s.PayloadColumns() {
		if _, ok := t.Columns[c]; !ok {
			add("payload", "the template names column %q, which table %s does not have (it has %s)", c, t.Ident(), t.columnList())
		}
	}
	return t, errors.Join(errs...)
}

// describe finds the table (search_path applies to an unqualified name)
// and its columns.
func describe(ctx context.Context, db DB, name string) (Table, error) {
	var t Table
	var path string
	err := db.QueryRow(ctx, `SELECT c.oid, n.nspname, c.relname
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE c.oid = to_regclass($1) AND c.relkind IN ('r', 'p')`, name).Scan(&t.OID, &t.Schema, &t.Name)
	if errors.Is(err, pgx.ErrNoRows) {
		_ = db.QueryRow(ctx, `SELECT current_setting('search_path')`).Scan(&path)
		return t, fmt.Errorf("%w: no table %q (search_path %s)", ErrSource, name, path)
	}
	if err != nil {
		return t, fmt.Errorf("look up table %q: %w", name, err)
	}
	rows, err := db.Query(ctx, `SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute
		WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped`, t.OID)
	if err != nil {
		return t, fmt.Errorf("columns of %s: %w", t.Ident(), err)
	}
	t.Columns = map[string]string{}
	for rows.Next() {
		var c, typ string
		if err := rows.Scan(&c, &typ); err != nil {
			return t, err
		}
		t.Columns[c] = typ
	}
	return t, rows.Err()
}

// uniqueColumn reports whether a unique index (or the primary key) covers
// exactly column, without a predicate or expression.
func uniqueColumn(ctx context.Context, db DB, table uint32, column string) (bool, error) {
	var ok bool
	err := db.QueryRow(ctx, `SELECT EXISTS (
		SELECT 1 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
		WHERE i.indrelid = $1 AND i.indisunique AND i.indnkeyatts = 1 AND i.indpred IS NULL AND i.indexprs IS NULL
		  AND a.attname = $2)`, table, column).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("indexes of the table: %w", err)
	}
	return ok, nil
}

func (t Table) columnList() string {
	cols := make([]string, 0, len(t.Columns))
	for c := range t.Columns {
		cols = append(cols, c)
	}
	sort.Strings(cols)
	return strings.Join(cols, ", ")
}
