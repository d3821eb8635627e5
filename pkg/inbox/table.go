package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/envspec"
)

// Table is the table a consumer dedupes through: fifobox's inbox (the zero
// Table), or a table a system's consumers already keep under their own
// name and shape (HoldCo's event_inbox(consumer_name, event_id,
// processed_at), the ticketing PRD's consumed_events(event_id, event_type,
// consumed_at)), so that a consumer moved onto fifobox recognises what its
// predecessor applied, and the other way round. The claim is one insert of
// the columns named here, ON CONFLICT on the key (consumer column and event
// id, or the event id alone) DO NOTHING.
type Table struct {
	// Name of the table, optionally schema-qualified. Default "inbox"
	// (fifobox's own, with every column below).
	Name string `json:"table,omitempty"`
	// EventID is the event id column (uuid, or text). Required with Name.
	EventID string `json:"event_id,omitempty"`
	// Consumer is the column holding the consumer's name; empty when the
	// table belongs to one consumer (its key is the event id alone).
	Consumer string `json:"consumer,omitempty"`
	// EventType, AggregateType, AggregateID and Sequence are optional
	// columns for the event's fields.
	EventType     string `json:"event_type,omitempty"`
	AggregateType string `json:"aggregate_type,omitempty"`
	AggregateID   string `json:"aggregate_id,omitempty"`
	Sequence      string `json:"sequence,omitempty"`
	// ProcessedAt is a column set to now(), for tables whose time column
	// has no default.
	ProcessedAt string `json:"processed_at,omitempty"`
}

// EnvInboxTable names a consumer's inbox table, as Table's JSON.
const EnvInboxTable = "FIFOBOX_INBOX_TABLE"

// TableEnv declares the variable TableFromEnv reads.
var TableEnv = envspec.Set{
	{Name: EnvInboxTable, Doc: `the table the consumer dedupes through, as JSON: {"table": "event_inbox", "consumer": "consumer_name", "event_id": "event_id", "processed_at": "processed_at"} (columns: event_id, consumer, event_type, aggregate_type, aggregate_id, sequence, processed_at); unset: fifobox's inbox`},
}

// TableFromEnv reads FIFOBOX_INBOX_TABLE (the zero Table when unset);
// errors name the variable.
func TableFromEnv() (Table, error) {
	var t Table
	v := strings.TrimSpace(TableEnv.Get(EnvInboxTable))
	if v == "" {
		return t, nil
	}
	d := json.NewDecoder(strings.NewReader(v))
	d.DisallowUnknownFields()
	if err := d.Decode(&t); err != nil {
		return t, fmt.Errorf("%s: %w", EnvInboxTable, err)
	}
	if _, err := t.compile(); err != nil {
		return t, fmt.Errorf("%s: %w", EnvInboxTable, err)
	}
	return t, nil
}

// fifoboxTable is fifobox's own inbox.
var fifoboxTable = Table{Name: "inbox", Consumer: "consumer", EventID: "event_id", AggregateType: "aggregate_type",
	AggregateID: "aggregate_id", Sequence: "sequence"}

var (
	tableNameRE  = regexp.MustCompile(`^([A-Za-z_][A-Za-z0-9_$]{0,62}\.)?[A-Za-z_][A-Za-z0-9_$]{0,62}$`)
	columnNameRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_$]{0,62}$`)
)

// claimer is a Table's claim statements: the one place their SQL is written.
type claimer struct {
	sql    string
	fields []string // which value each parameter is, in order
	table  Table
	ident  string
	key    []string
	cols   []string // the claim's columns, quoted
	vals   []string // each column's value: a field or now()
	// eventID is the event id column, quoted; unclaim deletes one claim.
	eventID string
	unclaim string
	bulk    sync.Map // records (int) -> the bulk claim's SQL
}

var defaultClaimer = mustCompile(Table{})

func mustCompile(t Table) *claimer {
	c, err := t.compile()
	if err != nil {
		panic(err)
	}
	return c
}

// compile checks the names and writes the claim; every problem is named
// by its JSON field.
func (t Table) compile() (*claimer, error) {
	if t == (Table{}) {
		t = fifoboxTable
	}
	var errs []error
	if !tableNameRE.MatchString(t.Name) {
		errs = append(errs, fmt.Errorf("table %q: a table name, optionally schema-qualified", t.Name))
	}
	if t.EventID == "" {
		errs = append(errs, errors.New("event_id: required: the event id column"))
	}
	c := &claimer{table: t}
	var cols, vals []string
	seen := map[string]string{}
	for _, f := range []struct{ field, col string }{
		{"consumer", t.Consumer}, {"event_id", t.EventID}, {"event_type", t.EventType}, {"aggregate_type", t.AggregateType},
		{"aggregate_id", t.AggregateID}, {"sequence", t.Sequence}, {"processed_at", t.ProcessedAt},
	} {
		if f.col == "" {
			continue
		}
		if !columnNameRE.MatchString(f.col) {
			errs = append(errs, fmt.Errorf("%s %q: a column name", f.field, f.col))
			continue
		}
		if other, ok := seen[f.col]; ok {
			errs = append(errs, fmt.Errorf("%s %q: column already used for %s", f.field, f.col, other))
			continue
		}
		seen[f.col] = f.field
		cols = append(cols, pgx.Identifier{f.col}.Sanitize())
		if f.field == "event_id" {
			c.eventID = pgx.Identifier{f.col}.Sanitize()
		}
		if f.field == "processed_at" {
			vals = append(vals, "now()")
			continue
		}
		c.fields = append(c.fields, f.field)
		vals = append(vals, fmt.Sprintf("$%d", len(c.fields)))
		if f.field == "consumer" || f.field == "event_id" {
			c.key = append(c.key, pgx.Identifier{f.col}.Sanitize())
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("inbox table: %w", err)
	}
	c.ident = pgx.Identifier(strings.Split(t.Name, ".")).Sanitize()
	c.sql = fmt.Sprintf("INSERT INTO %s (%s) VALUES (%s) ON CONFLICT (%s) DO NOTHING",
		c.ident, strings.Join(cols, ", "), strings.Join(vals, ", "), strings.Join(c.key, ", "))
	c.cols, c.vals = cols, vals
	var where []string
	for i, f := range c.fields {
		if f == "consumer" {
			where = append(where, fmt.Sprintf("%s = $%d", pgx.Identifier{t.Consumer}.Sanitize(), i+1))
		}
	}
	where = append(where, c.eventID+" = $"+strconv.Itoa(len(where)+1))
	c.unclaim = fmt.Sprintf("DELETE FROM %s WHERE %s", c.ident, strings.Join(where, " AND "))
	return c, nil
}

// bulkSQL is the claim of n events in one statement: one VALUES row each
// (so every value takes its column's type, as in the single claim), the
// consumer's name once ($1, if the table has its column), and the event
// ids actually inserted returned as text (a uuid column returns them in
// lower case).
func (c *claimer) bulkSQL(n int) string {
	if s, ok := c.bulk.Load(n); ok {
		return s.(string)
	}
	per := 0 // parameters per row besides the consumer
	for _, f := range c.fields {
		if f != "consumer" {
			per++
		}
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "INSERT INTO %s (%s) VALUES ", c.ident, strings.Join(c.cols, ", "))
	next := 1
	if c.table.Consumer != "" {
		next = 2
	}
	for i := 0; i < n; i++ {
		if i > 0 {
			sb.WriteString(", ")
		}
		sb.WriteByte('(')
		f := 0
		for j, v := range c.vals {
			if j > 0 {
				sb.WriteString(", ")
			}
			switch {
			case v == "now()":
				sb.WriteString(v)
			case c.fields[f] == "consumer":
				sb.WriteString("$1")
				f++
			default:
				sb.WriteString("$" + strconv.Itoa(next))
				next++
				f++
			}
		}
		sb.WriteByte(')')
	}
	fmt.Fprintf(&sb, " ON CONFLICT (%s) DO NOTHING RETURNING %s::text", strings.Join(c.key, ", "), c.eventID)
	s := sb.String()
	c.bulk.Store(n, s)
	return s
}

// bulkQuery claims every event of es for consumer in one statement (see
// bulkSQL); the rows it returns are the event ids it inserted.
func (c *claimer) bulkQuery(consumer string, es []envelope.Envelope) *pgx.QueuedQuery {
	args := make([]any, 0, 1+len(es)*len(c.fields))
	if c.table.Consumer != "" {
		args = append(args, consumer)
	}
	for _, e := range es {
		for _, f := range c.fields {
			if f != "consumer" {
				args = append(args, claimArg(f, consumer, e))
			}
		}
	}
	return &pgx.QueuedQuery{SQL: c.bulkSQL(len(es)), Arguments: args}
}

// unclaimQuery deletes e's claim for consumer: a claim the batch made for
// an event it then did not start (a Lambda's deadline).
func (c *claimer) unclaimQuery(consumer string, e envelope.Envelope) *pgx.QueuedQuery {
	if c.table.Consumer == "" {
		return &pgx.QueuedQuery{SQL: c.unclaim, Arguments: []any{e.ID}}
	}
	return &pgx.QueuedQuery{SQL: c.unclaim, Arguments: []any{consumer, e.ID}}
}

// query is the claim of e for consumer.
func (c *claimer) query(consumer string, e envelope.Envelope) *pgx.QueuedQuery {
	args := make([]any, len(c.fields))
	for i, f := range c.fields {
		args[i] = claimArg(f, consumer, e)
	}
	return &pgx.QueuedQuery{SQL: c.sql, Arguments: args}
}

// claimArg is the value of a claim's field.
func claimArg(field, consumer string, e envelope.Envelope) any {
	switch field {
	case "consumer":
		return consumer
	case "event_id":
		return e.ID
	case "event_type":
		return e.Type
	case "aggregate_type":
		return e.AggregateType
	case "aggregate_id":
		return e.AggregateID
	case "sequence":
		return e.Sequence
	}
	return nil
}

// CheckDB is what Check reads the catalog through.
type CheckDB interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Check verifies t against the database before a consumer starts: the
// table exists with every column named, and a unique index (or primary
// key) on exactly the key, so the claim cannot fail on ON CONFLICT at run
// time. Errors name the field.
func (t Table) Check(ctx context.Context, db CheckDB) error {
	c, err := t.compile()
	if err != nil {
		return err
	}
	tt := c.table
	var missing []string
	var unique, found bool
	cols := []string{tt.Consumer, tt.EventID, tt.EventType, tt.AggregateType, tt.AggregateID, tt.Sequence, tt.ProcessedAt}
	key := []string{tt.EventID}
	if tt.Consumer != "" {
		key = []string{tt.Consumer, tt.EventID}
	}
	err = db.QueryRow(ctx, `
		WITH t AS (SELECT to_regclass($1) AS oid)
		SELECT t.oid IS NOT NULL,
		       coalesce((SELECT array_agg(c) FROM unnest($2::text[]) c WHERE c <> '' AND NOT EXISTS (
		           SELECT 1 FROM pg_attribute a WHERE a.attrelid = t.oid AND a.attname = c AND a.attnum > 0 AND NOT a.attisdropped)), '{}'),
		       EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = t.oid AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL
		           AND i.indnkeyatts = cardinality($3::text[])
		           AND (SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_attribute a
		                WHERE a.attrelid = t.oid AND a.attnum = ANY (i.indkey::int2[])) = (SELECT array_agg(k ORDER BY k) FROM unnest($3::text[]) k))
		FROM t`, c.ident, cols, key).Scan(&found, &missing, &unique)
	if err != nil {
		return fmt.Errorf("inbox table %s: %w", tt.Name, err)
	}
	switch {
	case !found:
		return fmt.Errorf("inbox table: table %q: no such table", tt.Name)
	case len(missing) > 0:
		return fmt.Errorf("inbox table %s: no column %s", tt.Name, strings.Join(missing, ", "))
	case !unique:
		field := "event_id"
		if tt.Consumer != "" {
			field = "consumer, event_id"
		}
		return fmt.Errorf("inbox table %s: %s: no primary key or unique index on exactly (%s): two deliveries could both apply", tt.Name, field, strings.Join(key, ", "))
	}
	return nil
}

// Own says t is fifobox's own inbox, whose rows carry an outcome.
func (t Table) Own() bool { return t == (Table{}) || t == fifoboxTable }

// Claim writes e's claim row for consumer in tx, as applying it would, and
// says whether the row is new: an event an operator discarded counts as
// handled, so a later replay or copy of it is a duplicate. A table of the
// consumer's own has no outcome column; fifobox's inbox records a discard
// with outcome 'discarded' instead (pkg/redrive).
func (t Table) Claim(ctx context.Context, tx pgx.Tx, consumer string, e envelope.Envelope) (bool, error) {
	c, err := t.compile()
	if err != nil {
		return false, err
	}
	q := c.query(consumer, e)
	tag, err := tx.Exec(ctx, q.SQL, q.Arguments...)
	if err != nil {
		return false, fmt.Errorf("inbox table %s: claim: %w", c.table.Name, err)
	}
	return tag.RowsAffected() == 1, nil
}
