package capture_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/capture"
	"github.com/fifobox/fifobox/pkg/wire"
)

// The producers' tables as their documents define them.
var documentTables = map[string]string{
	// seeds/000: Prisma's EventOutbox mapped to event_outbox.
	"holdco": `CREATE TABLE event_outbox (
		id uuid PRIMARY KEY, group_id uuid NOT NULL, subsidiary_id uuid, aggregate_type text NOT NULL, aggregate_id uuid NOT NULL,
		event_type text NOT NULL, payload jsonb NOT NULL, status text NOT NULL DEFAULT 'pending',
		available_at timestamptz NOT NULL DEFAULT now(), attempts int NOT NULL DEFAULT 0, created_at timestamptz NOT NULL DEFAULT now())`,
	// seeds/001: billing_events, ULID ids, metadata inside the payload.
	"corebilling": `CREATE TABLE billing_events (
		id text PRIMARY KEY, subject text NOT NULL, tenant_id text NOT NULL, resource_id text, payload jsonb NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now())`,
	// seeds/002: the OUTBOX row its subscribers read (OUTBOX_ID, EVENT_TYPE, ...).
	"corewrite": `CREATE TABLE outbox (
		outbox_id uuid PRIMARY KEY, event_type text NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
		payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())`,
	// seeds/003: TR-6.
	"ticketing": `CREATE TABLE outbox (
		id uuid PRIMARY KEY, event_type varchar(100) NOT NULL, aggregate_id uuid NOT NULL, payload jsonb NOT NULL,
		published boolean NOT NULL DEFAULT false, created_at timestamp NOT NULL, published_at timestamp);
		CREATE INDEX ON outbox (published, created_at)`,
	// seeds/004: the wire test's SQL, as written.
	"transfers": `CREATE TABLE IF NOT EXISTS outbox (
		id uuid PRIMARY KEY,
		eventType text NOT NULL,
		payload jsonb NOT NULL,
		state text NOT NULL DEFAULT 'PENDING',
		attempts int NOT NULL DEFAULT 0,
		lastError text,
		next_attempt timestamptz NOT NULL DEFAULT now(),
		createdAt timestamptz NOT NULL DEFAULT now(),
		updatedAt timestamptz NOT NULL DEFAULT now()
	)`,
}

// Each built-in profile's source matches its document's table.
func TestBuiltInSourcesMatchTheDocumentsTables(t *testing.T) {
	t.Parallel()
	for name, ddl := range documentTables {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.NewEmpty(t)
			if _, err := db.Pool.Exec(context.Background(), ddl); err != nil {
				t.Fatal(err)
			}
			p, err := wire.Load(name)
			if err != nil {
				t.Fatal(err)
			}
			tab, err := capture.Check(context.Background(), db.Pool, p)
			if err != nil {
				t.Fatal(err)
			}
			if tab.Schema != db.Schema || tab.Name != p.Source.Table {
				t.Errorf("found %s", tab.Ident())
			}
		})
	}
}

// A source that does not fit the database is refused, every problem named
// by its profile field, before anything is installed.
func TestCheckNamesTheProfileField(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, profile, ddl string
		want               []string
	}{
		{"id column not unique", "holdco", strings.Replace(documentTables["holdco"], "id uuid PRIMARY KEY", "id uuid NOT NULL", 1),
			[]string{`profile holdco: source.event_id: column`, `"id" is not unique`}},
		{"unique only with a predicate", "corebilling", strings.Replace(documentTables["corebilling"], "id text PRIMARY KEY", "id text", 1) +
			`; CREATE UNIQUE INDEX ON billing_events (id) WHERE resource_id IS NOT NULL`,
			[]string{`source.event_id: column`, `"id" is not unique`}},
		{"json member of a text column", "transfers", strings.Replace(documentTables["transfers"], "payload jsonb", "payload text", 1),
			[]string{`source.aggregate_id: payload.key.transferId: column "payload" is text, not json or jsonb`,
				`source.event_id: payload.envelope.eventId: column "payload" is text`}},
		{"missing columns", "holdco", strings.Replace(strings.Replace(documentTables["holdco"], "group_id uuid NOT NULL,", "", 1), "subsidiary_id uuid,", "", 1),
			[]string{`source.tenant_id: table`, `has no column "group_id"`, `source.payload: the template names column "subsidiary_id"`}},
		{"ULID in a uuid column", "corebilling", strings.Replace(documentTables["corebilling"], "id text PRIMARY KEY", "id uuid PRIMARY KEY", 1),
			[]string{`source.event_id: column "id" is a uuid, but event_id_format is ulid`}},
		{"no table", "ticketing", `CREATE TABLE something_else (id int)`, []string{`profile ticketing: source.table:`, `no table "outbox"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.NewEmpty(t)
			if _, err := db.Pool.Exec(context.Background(), tt.ddl); err != nil {
				t.Fatal(err)
			}
			p, err := wire.Load(tt.profile)
			if err != nil {
				t.Fatal(err)
			}
			_, err = capture.Check(context.Background(), db.Pool, p)
			if !errors.Is(err, capture.ErrSource) {
				t.Fatalf("got %v, want ErrSource", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
		})
	}
}

// Mistakes in the source section's syntax are refused by Parse.
func TestSourceSyntax(t *testing.T) {
	for _, tt := range []struct{ source, want string }{
		{`{"table":"a b","event_id":"id","event_type":"t","aggregate_id":"a","aggregate_type":"x","payload":"p"}`, `source.table "a b"`},
		{`{"table":"t","event_type":"t","aggregate_id":"a","aggregate_type":"x","payload":"p"}`, `source.event_id: required`},
		{`{"table":"t","event_id":"id","event_type":"t","aggregate_id":"a","payload":"p"}`, `source.aggregate_type: required`},
		{`{"table":"t","event_id":"id","event_type":"t","aggregate_id":"payload..k","aggregate_type":"x","payload":"p"}`, `source.aggregate_id: "payload..k": an empty member`},
		{`{"table":"t","event_id":"id","event_type":"t","aggregate_id":"a","aggregate_type":"x"}`, `source.payload: required`},
		{`{"table":"t","event_id":"id","event_type":"t","aggregate_id":"a","aggregate_type":"x","payload":{"a":"x{b}"}}`, `source.payload.a: "x{b}": a source template value is a literal or exactly one {column}`},
	} {
		_, err := wire.Parse([]byte(`{"name":"p","body":{"id":"{event_id}"},"nats":{"subject":"x","stream":{"name":"S","subjects":["x"]}},"source":` + tt.source + `}`))
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: got %v, want %q", tt.source, err, tt.want)
		}
	}
}
