package cli

import (
	"context"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/internal/pgtest"
)

// fifobox capture checks a profile's mapping against the database before
// it installs anything, and names the profile field at fault; a mapping
// that fits is installed, and a producer's insert then becomes an event.
func TestCaptureChecksBeforeItInstalls(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	// seeds/000's event_outbox, but the id is not unique.
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE event_outbox (
		id uuid NOT NULL, group_id uuid NOT NULL, subsidiary_id uuid, aggregate_type text NOT NULL, aggregate_id uuid NOT NULL,
		event_type text NOT NULL, payload jsonb NOT NULL, status text NOT NULL DEFAULT 'pending',
		available_at timestamptz NOT NULL DEFAULT now(), attempts int NOT NULL DEFAULT 0, created_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		t.Fatal(err)
	}
	// A profile without the aggregate's key path is refused as it is read.
	noKey := `{"name": "mine", "body": {"id": "{event_id}"}, "nats": {"subject": "x", "stream": {"name": "S", "subjects": ["x"]}},
		"source": {"table": "event_outbox", "event_id": "id", "event_type": "event_type", "aggregate_type": "aggregate_type", "payload": "payload"}}`
	_, _, err := runCLI(t, "--database-url", db.URL, "capture", "--profile", noKey)
	if err == nil || !strings.Contains(err.Error(), "source.aggregate_id: required") {
		t.Fatalf("got %v, want the missing key path named", err)
	}
	_, _, err = runCLI(t, "--database-url", db.URL, "capture", "--profile", "holdco")
	if err == nil || !strings.Contains(err.Error(), `profile holdco: source.event_id: column`) || !strings.Contains(err.Error(), `"id" is not unique`) {
		t.Fatalf("got %v, want the non-unique id column named by its profile field", err)
	}
	var triggers int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'fifobox_capture%'
		AND tgrelid IN ('event_outbox'::regclass, 'outbox'::regclass, 'outbox_heads'::regclass)`).Scan(&triggers); err != nil || triggers != 0 {
		t.Fatalf("%d triggers after a refused mapping (%v)", triggers, err)
	}
	if _, err := db.Pool.Exec(ctx, `ALTER TABLE event_outbox ADD PRIMARY KEY (id)`); err != nil {
		t.Fatal(err)
	}
	out, _, err := runCLI(t, "--database-url", db.URL, "capture", "--profile", "holdco")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "capture installed: profile holdco delivers every row inserted into") {
		t.Errorf("printed %q", out)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO event_outbox (id, group_id, aggregate_type, aggregate_id, event_type, payload)
		VALUES (gen_random_uuid(), gen_random_uuid(), 'order', gen_random_uuid(), 'created', '{}')`); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox o JOIN event_outbox e ON e.id = o.event_id`).Scan(&n); err != nil || n != 1 {
		t.Errorf("%d events for the producer's row (%v)", n, err)
	}
	if _, _, err := runCLI(t, "--database-url", db.URL, "capture", "--profile", "holdco", "--uninstall"); err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'fifobox_capture%'
		AND tgrelid IN ('event_outbox'::regclass, 'outbox'::regclass, 'outbox_heads'::regclass)`).Scan(&triggers); err != nil || triggers != 0 {
		t.Errorf("%d triggers after --uninstall (%v)", triggers, err)
	}
}
