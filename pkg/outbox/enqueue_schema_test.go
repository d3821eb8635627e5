package outbox_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// A producer whose search_path is its own schema (holding a table of its
// own named outbox, as seeds/004's does) enqueues into fifobox's schema by
// naming it (Writer.Schema); without it, fifobox's function is not found and
// nothing is written anywhere.
func TestEnqueueIntoFifoboxSchemaFromAnotherPath(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fifobox := pgtest.New(t)
	app := pgtest.NewEmpty(t)
	if _, err := app.Pool.Exec(ctx, `CREATE TABLE outbox (id uuid PRIMARY KEY, eventType text NOT NULL, payload jsonb NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	ev := event("s-1", 1)
	err := pgx.BeginFunc(ctx, app.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, ev) })
	if err == nil {
		t.Fatal("Enqueue without fifobox on the search_path: no error")
	}
	w := outbox.Writer{Schema: fifobox.Schema}
	if err := pgx.BeginFunc(ctx, app.Pool, func(tx pgx.Tx) error { return w.Enqueue(ctx, tx, ev) }); err != nil {
		t.Fatal(err)
	}
	if n := count(t, fifobox.Pool, "event_id = '"+ev.ID+"'"); n != 1 {
		t.Fatalf("%d events in fifobox's outbox, want 1", n)
	}
	var theirs int
	if err := app.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&theirs); err != nil || theirs != 0 {
		t.Fatalf("the producer's own outbox: %d rows, %v", theirs, err)
	}
}
