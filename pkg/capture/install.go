package capture

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/wire"
)

// Beginner starts the transaction Install works in (a pool or a connection).
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// InstallConfig configures Install.
type InstallConfig struct {
	// Schema is where fifobox is installed (its outbox and
	// fifobox_enqueue_events). Default: the connection's current schema.
	Schema string
}

// Installation is what Install put in place.
type Installation struct {
	// Table is the producers' table.
	Table Table
	// Function is the trigger function that enqueues the rows each insert
	// statement writes; Trigger its trigger on Table.
	Function, Trigger string
	// SentFunction and SentTrigger (on fifobox's outbox_heads: an event is
	// sent when its aggregate's head moves past it), StatusFunction and
	// StatusTrigger (on fifobox's outbox: an event goes dead) keep the
	// table's status columns true; empty without a status section.
	SentFunction, SentTrigger     string
	StatusFunction, StatusTrigger string
	// EventIDIndex is the unique index Install made on the table's json
	// event id member (empty when the event id is a column).
	EventIDIndex string
}

// Install makes fifobox deliver what the producers write to their own
// table, unchanged: after Check, in one transaction, it installs an AFTER
// INSERT trigger (one call per statement, over its new rows) that enqueues
// each row through fifobox_enqueue_events, the same function every SQL
// producer calls, so the claim, ordering per aggregate and the dead state
// are fifobox's own. A row fifobox cannot enqueue (a missing aggregate id,
// an id that is no UUID or ULID) fails the producer's insert with the
// field named: nothing is dropped later. With a status section, a trigger
// on fifobox's outbox sets the row's status columns when its event is sent
// or dead. An event id held in a json member gets a unique index on that
// member (creating it fails, naming source.event_id, if two rows share an
// id). Install replaces an earlier installation of the same profile.
//
// Both functions are SECURITY DEFINER, owned by the installing user, with
// their search_path fixed to fifobox's schema: producers need no rights on
// fifobox's tables, the dispatcher none on the producers' table, and a
// caller's search_path (a user table named outbox) cannot redirect them.
func Install(ctx context.Context, db Beginner, p *wire.Profile, cfg InstallConfig) (Installation, error) {
	var inst Installation
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		schema := cfg.Schema
		if schema == "" {
			if err := tx.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
				return fmt.Errorf("capture: current schema: %w", err)
			}
		}
		var ok bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL AND to_regprocedure($2) IS NOT NULL`,
			pgx.Identifier{schema, "outbox"}.Sanitize(),
			pgx.Identifier{schema, "fifobox_ulid_to_uuid"}.Sanitize()+"(text)").Scan(&ok); err != nil {
			return fmt.Errorf("capture: look for fifobox in schema %q: %w", schema, err)
		}
		if !ok {
			return fmt.Errorf("capture: schema %q has no fifobox installation at the current version (run fifobox migrate there first)", schema)
		}
		// fifobox's connections put its schema first in search_path: an
		// unqualified source table named like one of fifobox's (seeds/004's
		// outbox) would resolve to fifobox's own table.
		names, err := migrations.ObjectNames()
		if err != nil {
			return fmt.Errorf("capture: %w", err)
		}
		var own bool
		if err := tx.QueryRow(ctx, `SELECT coalesce((SELECT relnamespace = $2::regnamespace AND relname = ANY($3)
			FROM pg_class WHERE oid = to_regclass($1)), false)`,
			p.Source.Table, pgx.Identifier{schema}.Sanitize(), names).Scan(&own); err != nil {
			return fmt.Errorf("capture: look up source.table: %w", err)
		}
		if own {
			return fmt.Errorf("%w: profile %s: source.table: %q is fifobox's own table in schema %s: name the producers' table with its schema (e.g. public.%s)",
				ErrSource, p.Name, p.Source.Table, schema, p.Source.Table)
		}
		t, err := Check(ctx, tx, p)
		if err != nil {
			return err
		}
		// The functions run with the installer's rights: a right missing
		// now would fail producers' inserts, or the dispatcher's marks,
		// later.
		var canEnqueue, canRead, canUpdate bool
		if err := tx.QueryRow(ctx, `SELECT coalesce((SELECT bool_or(has_function_privilege(p.oid, 'EXECUTE')) FROM pg_proc p
			WHERE p.pronamespace = $1::regnamespace AND p.proname = 'fifobox_enqueue_events'), false),
			has_table_privilege($2::regclass, 'SELECT'), has_table_privilege($3::oid, 'UPDATE')`,
			pgx.Identifier{schema}.Sanitize(), pgx.Identifier{schema, "outbox"}.Sanitize(), t.OID).Scan(&canEnqueue, &canRead, &canUpdate); err != nil {
			return fmt.Errorf("capture: check the installer's rights: %w", err)
		}
		switch {
		case !canEnqueue:
			return fmt.Errorf("capture: profile %s: the installing user cannot execute %s.fifobox_enqueue_events (grant it fifobox_producer)", p.Name, schema)
		case p.Source.Status != nil && !canRead:
			return fmt.Errorf("capture: profile %s: source.status: the installing user cannot read %s.outbox, which the status trigger joins", p.Name, schema)
		case p.Source.Status != nil && !canUpdate:
			return fmt.Errorf("capture: profile %s: source.status: the installing user cannot update %s", p.Name, t.Ident())
		}
		g := &gen{p: p, s: p.Source, t: t, schema: schema}
		inst = Installation{Table: t,
			Function: g.ident("fifobox_capture_" + p.Name), Trigger: "fifobox_capture_" + p.Name}
		stmts := []string{}
		if ref := p.Source.Refs()["event_id"][0]; len(ref.Path) > 0 {
			inst.EventIDIndex = "fifobox_capture_" + p.Name + "_event_id"
			stmts = append(stmts, fmt.Sprintf("CREATE UNIQUE INDEX IF NOT EXISTS %s ON %s ((%s))",
				pgx.Identifier{inst.EventIDIndex}.Sanitize(), t.Ident(), g.member(ref, "")))
		}
		fn, err := g.captureFunction(inst.Function)
		if err != nil {
			return err
		}
		stmts = append(stmts, fn,
			fmt.Sprintf("DROP TRIGGER IF EXISTS %s ON %s", pgx.Identifier{inst.Trigger}.Sanitize(), t.Ident()),
			fmt.Sprintf("CREATE TRIGGER %s AFTER INSERT ON %s REFERENCING NEW TABLE AS fifobox_new FOR EACH STATEMENT EXECUTE FUNCTION %s()",
				pgx.Identifier{inst.Trigger}.Sanitize(), t.Ident(), inst.Function))
		statusTrigger, sentTrigger := "fifobox_capture_status_"+p.Name, "fifobox_capture_sent_"+p.Name
		stmts = append(stmts,
			fmt.Sprintf("DROP TRIGGER IF EXISTS %s ON %s", pgx.Identifier{statusTrigger}.Sanitize(), g.ident("outbox")),
			fmt.Sprintf("DROP TRIGGER IF EXISTS %s ON %s", pgx.Identifier{sentTrigger}.Sanitize(), g.ident("outbox_heads")))
		if p.Source.Status != nil {
			inst.StatusFunction, inst.StatusTrigger = g.ident("fifobox_capture_status_"+p.Name), statusTrigger
			inst.SentFunction, inst.SentTrigger = g.ident("fifobox_capture_sent_"+p.Name), sentTrigger
			stmts = append(stmts, g.statusFunction(inst.StatusFunction),
				fmt.Sprintf(`CREATE TRIGGER %s AFTER UPDATE OF state ON %s FOR EACH ROW
WHEN (NEW.state IN ('sent', 'dead') AND OLD.state IS DISTINCT FROM NEW.state%s) EXECUTE FUNCTION %s()`,
					pgx.Identifier{statusTrigger}.Sanitize(), g.ident("outbox"), g.onlyType(), inst.StatusFunction),
				g.sentFunction(inst.SentFunction),
				fmt.Sprintf(`CREATE TRIGGER %s AFTER UPDATE OF next_seq ON %s FOR EACH ROW
WHEN (NEW.next_seq > OLD.next_seq%s) EXECUTE FUNCTION %s()`,
					pgx.Identifier{sentTrigger}.Sanitize(), g.ident("outbox_heads"), g.onlyType(), inst.SentFunction))
		}
		for _, q := range stmts {
			if _, err := tx.Exec(ctx, q); err != nil {
				var pe *pgconn.PgError
				if inst.EventIDIndex != "" && errors.As(err, &pe) && pe.Code == "23505" {
					return fmt.Errorf("%w: profile %s: source.event_id: %s: two rows of %s have the same event id (%s)",
						ErrSource, p.Name, p.Source.EventID, t.Ident(), pe.Detail)
				}
				return fmt.Errorf("capture: install profile %s on %s: %w", p.Name, t.Ident(), err)
			}
		}
		return nil
	})
	return inst, err
}

// Uninstall removes what Install put in place for profile (the event id
// index stays: it is the table's, and dropping it could only lose a check).
func Uninstall(ctx context.Context, db Beginner, p *wire.Profile, cfg InstallConfig) error {
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		schema := cfg.Schema
		if schema == "" {
			if err := tx.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
				return err
			}
		}
		t, err := describe(ctx, tx, p.Source.Table)
		if err != nil {
			return fmt.Errorf("profile %s: source.table: %w", p.Name, err)
		}
		g := &gen{schema: schema}
		for _, q := range []string{
			fmt.Sprintf("DROP TRIGGER IF EXISTS %s ON %s", pgx.Identifier{"fifobox_capture_" + p.Name}.Sanitize(), t.Ident()),
			fmt.Sprintf("DROP TRIGGER IF EXISTS %s ON %s", pgx.Identifier{"fifobox_capture_status_" + p.Name}.Sanitize(), g.ident("outbox")),
			fmt.Sprintf("DROP FUNCTION IF EXISTS %s()", g.ident("fifobox_capture_"+p.Name)),
			fmt.Sprintf("DROP FUNCTION IF EXISTS %s()", g.ident("fifobox_capture_status_"+p.Name)),
			fmt.Sprintf("DROP TRIGGER IF EXISTS %s ON %s", pgx.Identifier{"fifobox_capture_sent_" + p.Name}.Sanitize(), g.ident("outbox_heads")),
			fmt.Sprintf("DROP FUNCTION IF EXISTS %s()", g.ident("fifobox_capture_sent_"+p.Name)),
		} {
			if _, err := tx.Exec(ctx, q); err != nil {
				return fmt.Errorf("capture: uninstall profile %s: %w", p.Name, err)
			}
		}
		return nil
	})
}

// gen writes the SQL of one installation.
type gen struct {
	p      *wire.Profile
	s      *wire.Source
	t      Table
	schema string
}

func (g *gen) ident(name string) string { return pgx.Identifier{g.schema, name}.Sanitize() }

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// pathLiteral is a text[] literal for #> and #>>.
func pathLiteral(path []string) string {
	parts := make([]string, len(path))
	for i, p := range path {
		parts[i] = `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(p) + `"`
	}
	return quoteLiteral("{"+strings.Join(parts, ",")+"}") + "::text[]"
}

// member is a json member as text, or the column itself; alias qualifies it.
func (g *gen) member(r wire.ColumnRef, alias string) string {
	col := pgx.Identifier{r.Column}.Sanitize()
	if alias != "" {
		col = alias + "." + col
	}
	if len(r.Path) == 0 {
		return col
	}
	return fmt.Sprintf("%s #>> %s", col, pathLiteral(r.Path))
}

// textField is an event field as text: the first of its references not null.
func (g *gen) textField(field string) string {
	refs := g.s.Refs()[field]
	if len(refs) == 0 {
		if v := g.p.Defaults[field]; v != "" {
			return quoteLiteral(v) + "::text"
		}
		return "NULL::text"
	}
	alts := make([]string, len(refs))
	for i, r := range refs {
		e := "(" + g.member(r, "r") + ")"
		switch {
		case field == "event_id" && g.p.EventIDFormat == wire.ULID:
			e = "fifobox_ulid_to_uuid(" + e + "::text)::text"
		default:
			e += "::text"
		}
		alts[i] = e
	}
	if len(alts) == 1 {
		return alts[0]
	}
	return "coalesce(" + strings.Join(alts, ", ") + ")"
}

// timeValue is a reference as a timestamptz: a timestamp without time zone
// is read as UTC, whatever the session's TimeZone.
func (g *gen) timeValue(r wire.ColumnRef) string {
	e := g.member(r, "r")
	switch {
	case len(r.Path) > 0:
		return "(" + e + ")::timestamptz"
	case g.t.Columns[r.Column] == "timestamp with time zone":
		return e
	case strings.HasPrefix(g.t.Columns[r.Column], "timestamp"):
		return "(" + e + " AT TIME ZONE 'UTC')"
	}
	return "(" + e + ")::timestamptz"
}

func (g *gen) occurred() string {
	refs := g.s.Refs()["occurred_at"]
	if len(refs) == 0 {
		return "NULL::timestamptz"
	}
	alts := make([]string, len(refs))
	for i, r := range refs {
		alts[i] = g.timeValue(r)
	}
	if len(alts) == 1 {
		return alts[0]
	}
	return "coalesce(" + strings.Join(alts, ", ") + ")"
}

// payload is the event's payload as JSON text.
func (g *gen) payload() (string, error) {
	if tpl := g.s.PayloadTemplate(); tpl != nil {
		e, err := g.template(tpl)
		return "(" + e + ")::text", err
	}
	r := g.s.Refs()["payload"][0]
	col := "r." + pgx.Identifier{r.Column}.Sanitize()
	if len(r.Path) == 0 {
		return col + "::text", nil
	}
	return fmt.Sprintf("(%s #> %s)::text", col, pathLiteral(r.Path)), nil
}

// template builds a payload template with json_build_object, keeping its
// member order; a timestamp column becomes RFC 3339 in UTC.
func (g *gen) template(n *wire.TemplateNode) (string, error) {
	switch {
	case n.Members != nil:
		args := make([]string, 0, 2*len(n.Members))
		for _, m := range n.Members {
			v, err := g.template(m.Value)
			if err != nil {
				return "", err
			}
			args = append(args, quoteLiteral(m.Name), v)
		}
		return "json_build_object(" + strings.Join(args, ", ") + ")", nil
	case n.Column != "":
		c := "r." + pgx.Identifier{n.Column}.Sanitize()
		if strings.HasPrefix(g.t.Columns[n.Column], "timestamp") {
			return "to_json(fifobox_rfc3339(" + g.timeValue(wire.ColumnRef{Column: n.Column}) + "))", nil
		}
		return "to_json(" + c + ")", nil
	}
	if !json.Valid(n.Literal) {
		return "", fmt.Errorf("profile %s: source.payload: literal %s is not JSON", g.p.Name, n.Literal)
	}
	return quoteLiteral(string(n.Literal)) + "::json", nil
}

func (g *gen) captureFunction(name string) (string, error) {
	payload, err := g.payload()
	if err != nil {
		return "", err
	}
	idRef := g.s.EventID
	return fmt.Sprintf(`CREATE OR REPLACE FUNCTION %[1]s() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, %[2]s, pg_temp AS $fifobox$
-- Generated by fifobox (pkg/capture) from profile %[3]s: each row an insert
-- statement writes to %[4]s is enqueued, in the statement's order.
DECLARE
    ids text[]; types text[]; occurred timestamptz[]; agg_types text[]; agg_ids text[]; tenants text[];
    correlations text[]; causations text[]; traceparents text[]; payloads text[];
BEGIN
    SELECT array_agg(%[5]s), array_agg(%[6]s), array_agg(%[7]s), array_agg(%[8]s), array_agg(%[9]s),
           array_agg(%[10]s), array_agg(%[11]s), array_agg(%[12]s), array_agg(%[13]s), array_agg(%[14]s)
    INTO ids, types, occurred, agg_types, agg_ids, tenants, correlations, causations, traceparents, payloads
    FROM fifobox_new r;
    IF ids IS NULL THEN
        RETURN NULL;
    END IF;
    IF array_position(ids, NULL) IS NOT NULL THEN
        -- fifobox_enqueue_events would make up an id: refuse instead.
        RAISE EXCEPTION USING ERRCODE = '22004', COLUMN = 'id',
            MESSAGE = format('fifobox capture (profile %%s): row %%s of the insert into %%s has no event id (source.event_id: %%s)',
                %[15]s, array_position(ids, NULL), %[16]s, %[17]s);
    END IF;
    PERFORM fifobox_enqueue_events(ids, types, occurred, agg_types, agg_ids, tenants, correlations, causations,
        traceparents, array_fill(NULL::text, ARRAY[cardinality(ids)]), array_fill(NULL::bigint, ARRAY[cardinality(ids)]),
        payloads, 262144);
    RETURN NULL;
END
$fifobox$`, name, pgx.Identifier{g.schema}.Sanitize(), g.p.Name, g.t.Ident(),
		g.textField("event_id"), g.textField("event_type"), g.occurred(), g.textField("aggregate_type"),
		g.textField("aggregate_id"), g.textField("tenant_id"), g.textField("correlation_id"), g.textField("causation_id"),
		g.textField("traceparent"), payload,
		quoteLiteral(g.p.Name), quoteLiteral(g.t.Ident()), quoteLiteral(idRef)), nil
}

// onlyType narrows the status triggers to the profile's aggregate type when
// it is a constant (defaults.aggregate_type): events of other aggregates
// (fifobox's own producers, other captures) then cost them nothing.
func (g *gen) onlyType() string {
	if len(g.s.Refs()["aggregate_type"]) > 0 || g.p.Defaults["aggregate_type"] == "" {
		return ""
	}
	return " AND NEW.aggregate_type = " + quoteLiteral(g.p.Defaults["aggregate_type"])
}

// match finds the producer's row (alias t) of the event whose id is id.
func (g *gen) match(id string) string {
	r := g.s.Refs()["event_id"][0]
	col := "t." + pgx.Identifier{r.Column}.Sanitize()
	switch {
	case len(r.Path) > 0:
		return fmt.Sprintf("(%s) = %s::text", g.member(r, "t"), id)
	case g.p.EventIDFormat == wire.ULID:
		return fmt.Sprintf("%s = fifobox_uuid_to_ulid(%s)", col, id)
	case g.t.Columns[r.Column] == "uuid":
		return fmt.Sprintf("%s = %s", col, id)
	}
	return fmt.Sprintf("%s = %s::text", col, id)
}

// event is where a status value's placeholders come from: the outbox
// row's attempts and last error, as SQL.
type event struct{ attempts, lastError string }

// value is a status value as SQL of the target column's type (typ), or as
// jsonb for a json member (typ "").
func (g *gen) value(set wire.StatusSet, typ string, ev event) string {
	var e string
	switch set.Placeholder {
	case "{now}":
		e = "now()"
		if strings.HasPrefix(typ, "timestamp without") {
			e = "(now() AT TIME ZONE 'UTC')"
		}
	case "{attempts}":
		e = ev.attempts
	case "{last_error}":
		e = ev.lastError
	default:
		if typ == "" {
			return quoteLiteral(string(set.Value)) + "::jsonb"
		}
		var s string
		if json.Unmarshal(set.Value, &s) == nil {
			return quoteLiteral(s) + "::" + typ
		}
		return quoteLiteral(string(set.Value)) + "::" + typ
	}
	if typ == "" {
		return "coalesce(to_jsonb(" + e + "), 'null'::jsonb)"
	}
	return "(" + e + ")::" + typ
}

// sets is the SET list for state: json members of one column nest
// jsonb_set calls (a null value becomes JSON null, never a null column).
func (g *gen) sets(state string, ev event) string {
	var cols []string
	members := map[string]string{}
	for _, set := range g.s.StatusSets(state) {
		c := set.Target.Column
		typ := g.t.Columns[c]
		if len(set.Target.Path) == 0 {
			cols = append(cols, fmt.Sprintf("%s = %s", pgx.Identifier{c}.Sanitize(), g.value(set, typ, ev)))
			continue
		}
		cur, ok := members[c]
		if !ok {
			cur = "t." + pgx.Identifier{c}.Sanitize() + "::jsonb"
		}
		members[c] = fmt.Sprintf("jsonb_set(%s, %s, %s)", cur, pathLiteral(set.Target.Path), g.value(set, "", ev))
	}
	for _, c := range sortedKeys(members) {
		cols = append(cols, fmt.Sprintf("%s = %s::%s", pgx.Identifier{c}.Sanitize(), members[c], g.t.Columns[c]))
	}
	return strings.Join(cols, ", ")
}

// statusFunction follows an outbox row's own state: dead (and sent, as
// dispatchers before the watermark wrote it).
func (g *gen) statusFunction(name string) string {
	ev := event{attempts: "NEW.attempts", lastError: "NEW.last_error"}
	body := ""
	for _, state := range []string{"sent", "dead"} {
		if sets := g.sets(state, ev); sets != "" {
			body += fmt.Sprintf("    IF NEW.state = '%s' THEN\n        UPDATE %s AS t SET %s WHERE %s;\n    END IF;\n", state, g.t.Ident(), sets, g.match("NEW.event_id"))
		}
	}
	return fmt.Sprintf(`CREATE OR REPLACE FUNCTION %s() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, %s, pg_temp AS $fifobox$
-- Generated by fifobox (pkg/capture) from profile %s: the status columns of
-- %s follow an event that goes dead in fifobox's outbox.
BEGIN
%s    RETURN NULL;
END
$fifobox$`, name, pgx.Identifier{g.schema}.Sanitize(), g.p.Name, g.t.Ident(), body)
}

// sentFunction follows the watermark: when an aggregate's head moves from
// OLD.next_seq to NEW.next_seq, its events in between were published (the
// successful publish is one more attempt than the row counts).
func (g *gen) sentFunction(name string) string {
	ev := event{attempts: "o.attempts + 1", lastError: "o.last_error"}
	return fmt.Sprintf(`CREATE OR REPLACE FUNCTION %s() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, %s, pg_temp AS $fifobox$
-- Generated by fifobox (pkg/capture) from profile %s: the status columns of
-- %s follow the events an aggregate's head moves past (published).
BEGIN
    UPDATE %s AS t SET %s
    FROM outbox o
    WHERE o.aggregate_type = NEW.aggregate_type AND o.aggregate_id = NEW.aggregate_id
      AND o.aggregate_seq >= OLD.next_seq AND o.aggregate_seq < NEW.next_seq AND o.state = 'pending'
      AND %s;
    RETURN NULL;
END
$fifobox$`, name, pgx.Identifier{g.schema}.Sanitize(), g.p.Name, g.t.Ident(), g.t.Ident(), g.sets("sent", ev), g.match("o.event_id"))
}

func sortedKeys(m map[string]string) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
