package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/envelope/envelopetest"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// The SQL producer path (fifobox_enqueue, migrations/00013 and 00014) must be
// indistinguishable from outbox.Enqueue: the same events accepted, the same
// field named when not, and byte-for-byte the same stored rows.

// verdict is what one path did with an event: the field and kind it
// rejected it for, or the row it stored.
type verdict struct {
	Field, Kind string
	PGType      string // the SQL path only: rejected by PostgreSQL's type input (SQLSTATE) before the function ran
	Row         storedRow
}

type storedRow struct {
	EventID, Type, AggType, AggID, Tenant, Traceparent, State string
	Seq                                                       int64
	OccurredAt                                                time.Time
	Body                                                      string
}

const sqlSelectStored = `
SELECT event_id::text, event_type, aggregate_type, aggregate_id, coalesce(tenant_id, ''), coalesce(traceparent, ''),
       state::text, aggregate_seq, occurred_at, convert_from(body, 'UTF8')
FROM outbox ORDER BY id`

func readStored(ctx context.Context, tx pgx.Tx) ([]storedRow, error) {
	rows, err := tx.Query(ctx, sqlSelectStored)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (storedRow, error) {
		var s storedRow
		err := r.Scan(&s.EventID, &s.Type, &s.AggType, &s.AggID, &s.Tenant, &s.Traceparent, &s.State, &s.Seq, &s.OccurredAt, &s.Body)
		return s, err
	})
}

// viaGo enqueues e with outbox.Enqueue in a transaction it rolls back.
func viaGo(t testing.TB, pool *pgxpool.Pool, e envelope.Envelope) verdict {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := outbox.Enqueue(ctx, tx, e); err != nil {
		var ve *envelope.ValidationError
		if !errors.As(err, &ve) {
			t.Fatalf("Go Enqueue: not a validation error: %v", err)
		}
		for name, k := range envelopetest.Kinds {
			if errors.Is(err, k) {
				return verdict{Field: ve.Field, Kind: name}
			}
		}
		t.Fatalf("Go Enqueue: unknown kind: %v", err)
	}
	rows, err := readStored(ctx, tx)
	if err != nil || len(rows) != 1 {
		t.Fatalf("Go Enqueue stored %d rows (%v), want 1", len(rows), err)
	}
	checkEncoded(t, e, rows[0])
	return verdict{Row: rows[0]}
}

// checkEncoded: the body stored for e is envelope.Encode's, byte for byte,
// with the sequence the outbox gave it (since migration 00038 Enqueue
// stores what fifobox_enqueue_events builds, so this is what keeps the SQL
// encoder and Go's together). The outbox stores microseconds, as PostgreSQL
// keeps them.
func checkEncoded(t testing.TB, e envelope.Envelope, row storedRow) {
	t.Helper()
	e.Sequence = row.Seq
	e.OccurredAt = e.OccurredAt.Truncate(time.Microsecond)
	want, err := e.Encode()
	if err != nil {
		t.Fatalf("encode: %v", err)
	}
	if string(want) != row.Body {
		t.Errorf("stored body differs from envelope.Encode:\n got %s\nwant %s", row.Body, want)
	}
}

// sqlKinds maps fifobox_enqueue's SQLSTATEs to the envelope kinds.
var sqlKinds = map[string]string{"22004": "missing", "22023": "invalid", "54000": "too_large"}

// viaSQL enqueues e with fifobox_enqueue in a transaction it rolls back,
// passing every field as a client in another language would.
func viaSQL(t testing.TB, pool *pgxpool.Pool, e envelope.Envelope) verdict {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var id string
	var seq int64
	err = tx.QueryRow(ctx, `
		SELECT event_id::text, sequence FROM fifobox_enqueue(
		    aggregate_type => $1, aggregate_id => $2, type => $3, payload => $4, id => $5, occurred_at => $6,
		    tenant_id => $7, correlation_id => $8, causation_id => $9, traceparent => $10, tracestate => $11,
		    schema_version => $12)`,
		e.AggregateType, e.AggregateID, e.Type, string(e.Payload), e.ID, e.OccurredAt,
		e.TenantID, e.CorrelationID, e.CausationID, e.TraceParent, e.TraceState, int64(e.SchemaVersion)).Scan(&id, &seq)
	if err != nil {
		return sqlRejection(t, "fifobox_enqueue", err)
	}
	rows, err := readStored(ctx, tx)
	if err != nil || len(rows) != 1 {
		t.Fatalf("fifobox_enqueue stored %d rows (%v), want 1", len(rows), err)
	}
	if rows[0].EventID != strings.ToLower(id) || rows[0].Seq != seq {
		t.Errorf("fifobox_enqueue returned (%s, %d), stored (%s, %d)", id, seq, rows[0].EventID, rows[0].Seq)
	}
	return verdict{Row: rows[0]}
}

// sqlRejection is the verdict of a SQL enqueue that failed: the field and
// kind of a validation error (whose message must name the field), or the
// SQLSTATE of any other.
func sqlRejection(t testing.TB, fn string, err error) verdict {
	t.Helper()
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		t.Fatalf("%s: %v", fn, err)
	}
	if kind, ok := sqlKinds[pe.Code]; ok {
		if !strings.Contains(pe.Message, pe.ColumnName) {
			t.Errorf("%s: message %q does not name the field %q", fn, pe.Message, pe.ColumnName)
		}
		return verdict{Field: pe.ColumnName, Kind: kind}
	}
	return verdict{PGType: pe.Code}
}

// viaSQLBatch enqueues e with fifobox_enqueue_batch, as a one-event JSON
// array written the way a client in another language writes it (the
// payload embedded as given), in a transaction it rolls back.
func viaSQLBatch(t testing.TB, pool *pgxpool.Pool, e envelope.Envelope) verdict {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	str := func(v string) string { b, _ := json.Marshal(v); return string(b) }
	var b strings.Builder
	b.WriteString(`[{"id":` + str(e.ID) + `,"type":` + str(e.Type) + `,"occurred_at":` + str(e.OccurredAt.Format(time.RFC3339Nano)) +
		`,"aggregate_type":` + str(e.AggregateType) + `,"aggregate_id":` + str(e.AggregateID) +
		`,"schema_version":` + fmt.Sprint(e.SchemaVersion))
	for _, f := range []struct{ k, v string }{{"tenant_id", e.TenantID}, {"correlation_id", e.CorrelationID},
		{"causation_id", e.CausationID}, {"traceparent", e.TraceParent}, {"tracestate", e.TraceState}} {
		if f.v != "" {
			b.WriteString(`,"` + f.k + `":` + str(f.v))
		}
	}
	b.WriteString(`,"payload":` + string(e.Payload) + `}]`)
	if _, err := tx.Exec(ctx, `SELECT fifobox_enqueue_batch($1::json)`, b.String()); err != nil {
		return sqlRejection(t, "fifobox_enqueue_batch", err)
	}
	rows, err := readStored(ctx, tx)
	if err != nil || len(rows) != 1 {
		t.Fatalf("fifobox_enqueue_batch stored %d rows (%v), want 1", len(rows), err)
	}
	return verdict{Row: rows[0]}
}

// batchExpressible says whether e can be written as a batch element at all:
// its payload must be JSON (the array is), and its time a four-digit year
// (RFC 3339) that PostgreSQL reads as text: year 0000 is 1 BC to Go and no
// year to PostgreSQL's date input.
func batchExpressible(e envelope.Envelope) bool {
	y := e.OccurredAt.Year()
	return json.Valid(e.Payload) && y >= 1 && y <= 9999
}

// unrepresentable says why PostgreSQL cannot even receive e's fields as
// the function's argument types ("" if it can): text must be UTF-8 without
// NUL, timestamps within PostgreSQL's range. The type input rejects those
// with its own SQLSTATE before fifobox_enqueue runs; Go rejects them as
// invalid fields, so either way nothing is written.
func unrepresentable(e envelope.Envelope) string {
	for _, s := range []string{e.ID, e.Type, e.AggregateType, e.AggregateID, e.TenantID, e.CorrelationID,
		e.CausationID, e.TraceParent, e.TraceState, string(e.Payload)} {
		if !utf8.ValidString(s) || strings.ContainsRune(s, 0) {
			return "22021" // character_not_in_repertoire
		}
	}
	if y := e.OccurredAt.UTC().Year(); y > 294275 || y < -4712 {
		return "22008" // datetime_field_overflow
	}
	return ""
}

// agree fails t unless the Go and SQL verdicts on e match.
func agree(t testing.TB, pool *pgxpool.Pool, e envelope.Envelope) (goV, sqlV verdict) {
	t.Helper()
	// PostgreSQL keeps microseconds: a SQL producer cannot state finer
	// time, so compare on what both can say.
	e.OccurredAt = e.OccurredAt.Truncate(time.Microsecond)
	goV, sqlV = viaGo(t, pool, e), viaSQL(t, pool, e)
	if code := unrepresentable(e); code != "" {
		if goV.Kind == "" || sqlV.PGType == "" {
			t.Fatalf("an envelope PostgreSQL cannot receive (%s): Go %+v, SQL %+v; want both to reject it", code, goV, sqlV)
		}
		return
	}
	if sqlV.PGType != "" {
		t.Fatalf("fifobox_enqueue failed with SQLSTATE %s, not a validation error; Go: %+v", sqlV.PGType, goV)
	}
	if goV.Field != sqlV.Field || goV.Kind != sqlV.Kind {
		t.Fatalf("Go rejects for %q (%s), SQL for %q (%s)", goV.Field, goV.Kind, sqlV.Field, sqlV.Kind)
	}
	if goV.Field == "" && !reflect.DeepEqual(goV.Row, sqlV.Row) {
		t.Fatalf("stored rows differ:\nGo:  %+v\nSQL: %+v", goV.Row, sqlV.Row)
	}
	// The batch entry point: the same verdict and the same row.
	if batchExpressible(e) {
		bV := viaSQLBatch(t, pool, e)
		if bV.PGType != "" || bV.Field != goV.Field || bV.Kind != goV.Kind {
			t.Fatalf("fifobox_enqueue_batch: %+v; Go: field %q kind %q", bV, goV.Field, goV.Kind)
		}
		if goV.Field == "" && !reflect.DeepEqual(goV.Row, bV.Row) {
			t.Fatalf("stored rows differ:\nGo:    %+v\nbatch: %+v", goV.Row, bV.Row)
		}
	}
	return
}

// TestSQLEnqueueFollowsTheValidationTable runs pkg/envelope's shared case
// table through both paths.
func TestSQLEnqueueFollowsTheValidationTable(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	table, err := envelopetest.Load()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range table.Cases {
		t.Run(c.Name, func(t *testing.T) {
			e, err := c.Build(table.Base)
			if err != nil {
				t.Fatal(err)
			}
			goV, sqlV := agree(t, db.Pool, e)
			// Enqueue ignores the sequence (the outbox assigns it), so a
			// sequence case is valid for both; every other case must get the
			// table's verdict from both paths.
			if c.Field != "sequence" && (goV.Field != c.Field || goV.Kind != c.Kind) {
				t.Fatalf("Go Enqueue: %+v, the table wants field %q kind %q", goV, c.Field, c.Kind)
			}
			if c.Field == "" && sqlV.Row.Body == "" {
				t.Fatal("valid case stored nothing through SQL")
			}
		})
	}
}

// TestSQLEnqueueAgreesWithGoOnRandomEnvelopes mutates valid envelopes at
// random, a field or two at a time, with values near the rules' edges, and
// requires the same verdict and the same stored row from both paths.
func TestSQLEnqueueAgreesWithGoOnRandomEnvelopes(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	rng := rand.New(rand.NewPCG(19, 2026))
	n := 400
	if testing.Short() {
		n = 100
	}
	for i := 0; i < n; i++ {
		e := randomEnvelope(rng)
		t.Run(fmt.Sprint(i), func(t *testing.T) { agree(t, db.Pool, e) })
	}
}

// FuzzSQLEnqueueMatchesGo is the fuzz pair: whatever Go accepts, SQL
// accepts with the identical row; whatever one rejects, the other rejects
// for the same field.
//
//	go test -run '^$' -fuzz FuzzSQLEnqueueMatchesGo -fuzztime 2m ./pkg/outbox/
func FuzzSQLEnqueueMatchesGo(f *testing.F) {
	f.Add("0190f3a4-7c1e-7b2a-9f00-1234567890ab", "order.created", "order", "o-1", "acme", "c-1",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "a=b,c@d=e", int64(1_700_000_000_123_456), 60, int64(2), `{"a": [1, 2.5e3, "x\"y"]}`)
	f.Add("0190F3A4-7C1E-7B2A-9F00-1234567890AB", "t", "a", `"\`, "\u2028ü", "", "", "", int64(-62135596800_000_000), 0, int64(1), `{"a":1,"a":2}`)
	f.Add("0190f3a4-7c1e-7b2a-9f00-1234567890ab", "t", "a", "b", "", "", "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x", " k=v ,,", int64(0), -90, int64(1), `[1e308, 1e-400, -0]`)
	f.Add("0190f3a4-7c1e-7b2a-9f00-1234567890ab", "t", "a", "b", "", "", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-", "a=", int64(253402300799_999_999), 0, int64(2147483648), `"\ud83d\ude00 \ud800"`)
	f.Fuzz(func(t *testing.T, id, typ, aggType, aggID, tenant, corr, tp, ts string, micros int64, offsetMin int, schema int64, payload string) {
		// Fold the numbers into the ranges where the rules have edges, so the
		// fuzzer spends its time on both sides of them.
		offsetMin %= 1440
		if schema < -1<<32 || schema > 1<<32 {
			schema %= 3
		}
		const tenThousandYears = 315_569_520_000_000_000 // microseconds
		if micros < -tenThousandYears || micros > tenThousandYears {
			micros %= tenThousandYears
		}
		occurred := time.UnixMicro(micros).In(time.FixedZone("", offsetMin*60))
		e := envelope.Envelope{ID: id, Type: typ, OccurredAt: occurred, AggregateType: aggType, AggregateID: aggID,
			TenantID: tenant, CorrelationID: corr, CausationID: corr, TraceParent: tp, TraceState: ts,
			SchemaVersion: int(schema), Payload: json.RawMessage(payload)}
		agree(t, fuzzDB(t), e)
	})
}

var fuzzPool *pgxpool.Pool

// fuzzDB is one database for the whole fuzz run: each input's transaction
// is rolled back, so inputs never see each other.
func fuzzDB(t *testing.T) *pgxpool.Pool {
	if fuzzPool == nil {
		fuzzPool = pgtest.New(&testing.T{}).Pool // outlives the first input's t
	}
	return fuzzPool
}

// randomEnvelope is a valid envelope with zero to two fields replaced by
// values drawn near the rules' edges.
func randomEnvelope(rng *rand.Rand) envelope.Envelope {
	pick := func(xs ...string) string { return xs[rng.IntN(len(xs))] }
	e := envelope.Envelope{
		ID: "0190f3a4-7c1e-7b2a-9f00-1234567890ab", Type: "order.created", AggregateType: "order", AggregateID: "order-42",
		OccurredAt: time.Date(2026, 11, 22, 10, 0, 0, 123456000, time.UTC), SchemaVersion: 1, Payload: json.RawMessage(`{"a":1}`),
	}
	for n := rng.IntN(3); n > 0; n-- {
		switch rng.IntN(11) {
		case 0:
			e.ID = pick("", "0190f3a4-7c1e-7b2a-9f00-1234567890aG", "0190f3a47c1e7b2a9f001234567890ab", "0190f3a4-7c1e-7b2a-9f00-1234567890AB", "{0190f3a4-7c1e-7b2a-9f00-1234567890}")
		case 1:
			e.Type = pick("", "a b", strings.Repeat("t", 256), strings.Repeat("t", 257), "x.y_z-1:2/3", "é", "a\tb")
		case 2:
			e.AggregateType = pick("", strings.Repeat("a", 128), strings.Repeat("a", 129), "a+b")
		case 3:
			e.AggregateID = pick("", "a b", `!"#$%&'()*+,-./:;<=>?@[\]^_`+"`{|}~", strings.Repeat("x", 129), "ü", `q"\`)
		case 4:
			e.TenantID = pick("", "ü", "a\x7fb", strings.Repeat("ü", 128), strings.Repeat("ü", 129), "\u2028\u2029", `"\`, "\u0085")
		case 5:
			e.CorrelationID = pick("", "c 1", `"q"`)
			e.CausationID = pick("", strings.Repeat("c", 129), "\\")
		case 6:
			e.TraceParent = pick("", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
				"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-04", "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
				"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09-abc",
				"00-00000000000000000000000000000000-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
				"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x")
			e.TraceState = pick("", "a=b", "a=b,a=c", "A=b", "a@b=c", "1a@b=c", "a= b", "a=b ", " a=b", "a =b", "a=b,,c=d", "a=", "a=b=c",
				"k"+strings.Repeat("x", 255)+"=v", "k"+strings.Repeat("x", 256)+"=v", "a="+strings.Repeat("v", 256), "a="+strings.Repeat("v", 257),
				strings.TrimSuffix(strings.Repeat("k=v,", 32), ","), func() string {
					var b strings.Builder
					for i := 0; i < 33; i++ {
						fmt.Fprintf(&b, "k%d=v,", i)
					}
					return b.String()
				}(), func() string {
					var b strings.Builder
					for i := 0; i < 32; i++ {
						fmt.Fprintf(&b, "k%d=v,", i)
					}
					return b.String()
				}())
		case 7:
			e.SchemaVersion = []int{0, -1, 1, 2147483647, 2147483648}[rng.IntN(5)]
		case 8:
			e.OccurredAt = []time.Time{{}, time.Date(1, 1, 1, 0, 0, 0, 1000, time.UTC), time.Date(0, 12, 31, 23, 0, 0, 0, time.UTC),
				time.Date(9999, 12, 31, 23, 59, 59, 999999000, time.UTC), time.Date(9999, 12, 31, 23, 0, 0, 0, time.FixedZone("", -3600)),
				time.Date(1, 1, 1, 0, 30, 0, 0, time.FixedZone("", 3600)), time.Date(2026, 1, 2, 3, 4, 5, 100000000, time.FixedZone("", 19800))}[rng.IntN(7)]
		default:
			e.Payload = json.RawMessage(pick(`{}`, `[]`, `null`, ` null `, ``, `  `, `"s"`, `0`, `-0.0e-0`, `{"a":1,"a":2}`, `{"a":1,"\u0061":2}`,
				`{"a":{"b":1,"b":2}}`, `[{"a":1},{"a":1}]`, `{"a":1,"A":2}`, `1e308`, `1e309`, `-1e309`, `1e-400`, `1.7976931348623157e308`,
				`1.7976931348623158e308`, `1.797693134862315807e308`, `179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497791`,
				`179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792`,
				`0.000000000000000000000000000000000000000001e350`, `"\u0000"`, `"\\u0000"`, `"\\\u0000"`, `"\ud800"`, `"\udc00"`, `"\ud800\udc00"`,
				`"\ud800\u0041"`, `"\ud800x\udc00"`, `"\uD83D\uDE00"`, `{ "a" : [ 1 , 2 ] }`, "{\n\t\"a\":\r\n1}", `"<&>"`, `{"x":"a b"}`,
				strings.Repeat("[", 32)+strings.Repeat("]", 32), strings.Repeat("[", 33)+strings.Repeat("]", 33),
				`[`+strings.Repeat(`{"a":[`, 16)+strings.Repeat(`]}`, 16)+`]`, `{"a":"`+strings.Repeat("x", 262000)+`"}`,
				`{"a":"`+strings.Repeat("x", 261800)+`"}`, `{"a":"\u2028"}`, `01`, `1.`, `.5`, `+1`, `[1,]`, `{"a":1}{}`, `"a\u00e9\""`))
		}
	}
	return e
}

// TestSQLEnqueueBatch: fifobox_enqueue_batch stores a JSON array of
// envelopes exactly as one Go Enqueue call stores the same events, and an
// invalid one anywhere in the array writes nothing and names the event and
// the field.
func TestSQLEnqueueBatch(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	at := time.Date(2026, 11, 22, 10, 0, 0, 123456000, time.FixedZone("", 3600))
	evs := []envelope.Envelope{
		{ID: "0190f3a4-7c1e-7b2a-9f00-000000000001", Type: "order.created", OccurredAt: at, AggregateType: "order", AggregateID: "o-1",
			TenantID: "acme", TraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", TraceState: "k=v", SchemaVersion: 2,
			Payload: json.RawMessage(`{ "items" : [ {"sku": "A 1", "qty": 2} ], "note": "caf\u00e9 \"x\"" }`)},
		{ID: "0190f3a4-7c1e-7b2a-9f00-000000000002", Type: "customer.updated", OccurredAt: at, AggregateType: "customer", AggregateID: "c-9",
			SchemaVersion: 1, Payload: json.RawMessage(`[]`)},
		{ID: "0190f3a4-7c1e-7b2a-9f00-000000000003", Type: "order.paid", OccurredAt: at, AggregateType: "order", AggregateID: "o-1",
			CorrelationID: "corr", CausationID: "0190f3a4-7c1e-7b2a-9f00-000000000001", SchemaVersion: 1, Payload: json.RawMessage(`{"amount":1e2}`)},
	}
	doc := func(evs []envelope.Envelope) string {
		items := make([]map[string]any, len(evs))
		for i, e := range evs {
			m := map[string]any{"id": e.ID, "type": e.Type, "occurred_at": e.OccurredAt.Format(time.RFC3339Nano), "aggregate_type": e.AggregateType,
				"aggregate_id": e.AggregateID, "schema_version": e.SchemaVersion, "payload": e.Payload}
			for k, v := range map[string]string{"tenant_id": e.TenantID, "correlation_id": e.CorrelationID, "causation_id": e.CausationID,
				"traceparent": e.TraceParent, "tracestate": e.TraceState} {
				if v != "" {
					m[k] = v
				}
			}
			items[i] = m
		}
		b, _ := json.Marshal(items)
		return string(b)
	}
	stored := func(enqueue func(tx pgx.Tx) error) ([]storedRow, error) {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if err := enqueue(tx); err != nil {
			return nil, err
		}
		return readStored(ctx, tx)
	}
	// Arrays with and without escapes take the quick checks
	// (migrations/00014); an escaped ':' sends the whole array through the
	// full ones. All must store and reject alike.
	plainEvs := append([]envelope.Envelope(nil), evs...)
	plainEvs[0].Payload = json.RawMessage(`{ "items" : [ {"sku": "A 1", "qty": 2} ], "note": "cafe x" }`)
	colonEvs := append([]envelope.Envelope(nil), evs...)
	colonEvs[0].Payload = json.RawMessage(`{"note": "a\u003ab", "n": 1}`)
	// A payload that is a JSON string keeps its \u escapes as written
	// (json_to_recordset would store "café" where Go stores "caf\u00e9").
	stringEvs := append([]envelope.Envelope(nil), evs...)
	stringEvs[0].Payload = json.RawMessage(`"caf\u00e9 \"x\""`)
	stringEvs[2].Payload = json.RawMessage(`"plain"`)
	for _, base := range []struct {
		name string
		evs  []envelope.Envelope
	}{{"escaped", evs}, {"plain", plainEvs}, {"escaped colon", colonEvs}, {"string payloads", stringEvs}} {
		evs := base.evs
		goRows, err := stored(func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, evs...) })
		if err != nil {
			t.Fatal(err)
		}
		for i, row := range goRows {
			checkEncoded(t, evs[i], row)
		}
		sqlRows, err := stored(func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, `SELECT event_id::text, sequence FROM fifobox_enqueue_batch($1::json)`, doc(evs))
			if err != nil {
				return err
			}
			got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
				ID  string
				Seq int64
			}])
			if err == nil && (len(got) != 3 || got[0].Seq != 1 || got[1].Seq != 1 || got[2].Seq != 2 || got[2].ID != evs[2].ID) {
				err = fmt.Errorf("returned %+v, want the events in order with sequences 1, 1, 2", got)
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(goRows, sqlRows) {
			t.Fatalf("%s: stored rows differ:\nGo:  %+v\nSQL: %+v", base.name, goRows, sqlRows)
		}

		bad := []struct {
			name, doc, field, code string
		}{
			{"invalid third event", strings.Replace(doc(evs), `"aggregate_id":"o-1","aggregate_type":"order","causation_id"`, `"aggregate_id":"o 1","aggregate_type":"order","causation_id"`, 1), "aggregate_id", "22023"},
			{"unknown member", strings.Replace(doc(evs), `"aggregate_id":"c-9"`, `"aggregate_id":"c-9","aggregateId":"c-9"`, 1), "aggregateId", "22023"},
			{"sequence is the outbox's", strings.Replace(doc(evs), `"aggregate_id":"c-9"`, `"aggregate_id":"c-9","sequence":4`, 1), "sequence", "22023"},
			{"wrong JSON type", strings.Replace(doc(evs), `"aggregate_id":"c-9"`, `"aggregate_id":9`, 1), "aggregate_id", "22023"},
			{"not RFC 3339", strings.Replace(doc(evs), `"occurred_at":"2026-11-22T10:00:00.123456+01:00","payload":[]`, `"occurred_at":"today","payload":[]`, 1), "occurred_at", "22023"},
			{"no such date", strings.Replace(doc(evs), `"occurred_at":"2026-11-22T10:00:00.123456+01:00","payload":[]`, `"occurred_at":"2026-02-30T10:00:00Z","payload":[]`, 1), "occurred_at", "22023"},
			{"schema_version not an integer", strings.Replace(doc(evs), `"schema_version":1,"type":"customer.updated"`, `"schema_version":1.5,"type":"customer.updated"`, 1), "schema_version", "22023"},
			{"null payload", strings.Replace(doc(evs), `"payload":[]`, `"payload":null`, 1), "payload", "22004"},
			{"missing type", strings.Replace(doc(evs), `,"type":"customer.updated"`, ``, 1), "type", "22004"},
			{"same id twice", strings.Replace(doc(evs), evs[1].ID, evs[0].ID, 1), "id", "22023"},
			{"not an array", `{"id":"x"}`, "events", "22023"},
			{"member twice", strings.Replace(doc(evs), `"aggregate_id":"c-9"`, `"aggregate_id":"c-9","aggregate_id":"c-9"`, 1), "aggregate_id", "22023"},
			{"not an object", "[1," + doc(evs)[1:], "envelope", "22023"},
			{"schema_version a string", strings.Replace(doc(evs), `"schema_version":1,"type":"customer.updated"`, `"schema_version":"1","type":"customer.updated"`, 1), "schema_version", "22023"},
			{"schema_version with an exponent", strings.Replace(doc(evs), `"schema_version":1,"type":"customer.updated"`, `"schema_version":1e0,"type":"customer.updated"`, 1), "schema_version", "22023"},
			{"payload member twice", strings.Replace(doc(evs), `"payload":[]`, `"payload":{"a":1,"a":2}`, 1), "payload", "22023"},
			{"payload number too large", strings.Replace(doc(evs), `"payload":[]`, `"payload":[1e309]`, 1), "payload", "22023"},
			{"payload too deep", strings.Replace(doc(evs), `"payload":[]`, `"payload":`+strings.Repeat("[", 33)+strings.Repeat("]", 33), 1), "payload", "22023"},
			{"occurred_at escaped", strings.Replace(doc(evs), `"occurred_at":"2026-11-22T10:00:00.123456+01:00","payload":[]`, `"occurred_at":"\u0032026-11-22T10:00:00.123456+01:00","payload":[]`, 1), "occurred_at", "22023"},
			{"payload beyond numeric", strings.Replace(doc(evs), `"payload":[]`, `"payload":[1e999999]`, 1), "payload", "22023"},
		}
		for _, c := range bad {
			t.Run(base.name+"/"+c.name, func(t *testing.T) {
				if c.doc == doc(evs) {
					t.Fatal("the case changed nothing")
				}
				rows, err := stored(func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `SELECT fifobox_enqueue_batch($1::json)`, c.doc)
					return err
				})
				var pe *pgconn.PgError
				if !errors.As(err, &pe) || pe.Code != c.code || pe.ColumnName != c.field {
					t.Fatalf("err = %v (rows %d), want SQLSTATE %s naming %s", err, len(rows), c.code, c.field)
				}
				if c.field != "events" && !strings.HasPrefix(pe.Message, "enqueue event ") {
					t.Errorf("message %q does not say which event", pe.Message)
				}
			})
		}
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d rows left behind (%v)", n, err)
	}
}
