package envelope_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/envelope/envelopetest"
)

// build applies a case to the table's base envelope (JSON field names).
func build(t *testing.T, c envelopetest.Case, base map[string]any) envelope.Envelope {
	t.Helper()
	e, err := c.Build(base)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// TestValidationTable runs testdata/validation.json: every rule, at and
// past its limit, with the field each error names. Whatever it accepts
// must also round-trip.
func TestValidationTable(t *testing.T) {
	t.Parallel()
	table, err := envelopetest.Load()
	if err != nil {
		t.Fatal(err)
	}
	kinds := envelopetest.Kinds
	for _, c := range table.Cases {
		t.Run(c.Name, func(t *testing.T) {
			e := build(t, c, table.Base)
			err := e.Validate()
			if c.Field == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want valid", err)
				}
				assertRoundTrip(t, e)
				return
			}
			var ve *envelope.ValidationError
			if !errors.As(err, &ve) || ve.Field != c.Field || !errors.Is(err, kinds[c.Kind]) {
				t.Fatalf("Validate() = %v, want a %s error naming %s", err, c.Kind, c.Field)
			}
			if !strings.Contains(err.Error(), c.Field) {
				t.Errorf("message %q does not name the field", err)
			}
		})
	}
}

// normalized is what Decode(Encode(e)) must return for a valid e: the
// payload compacted, occurred_at in UTC.
func normalized(t testing.TB, e envelope.Envelope) envelope.Envelope {
	var b bytes.Buffer
	if err := json.Compact(&b, e.Payload); err != nil {
		t.Fatalf("compact a valid payload: %v", err)
	}
	e.Payload = b.Bytes()
	e.OccurredAt = e.OccurredAt.Round(0).UTC()
	return e
}

// assertRoundTrip is the property: an envelope Validate accepts encodes to
// a UTF-8 body no deeper than the payload limit plus one, which Decode
// reads back to the same envelope, and which re-encodes to the same bytes.
func assertRoundTrip(t testing.TB, e envelope.Envelope) {
	t.Helper()
	body, err := e.Encode()
	if err != nil {
		t.Fatalf("Encode: %v", err)
	}
	if !utf8.Valid(body) {
		t.Fatalf("body is not UTF-8 (SNS requires it): %q", body)
	}
	if d := depth(body); d > envelope.MaxPayloadDepth+1 {
		t.Fatalf("body nests %d deep", d)
	}
	got, err := envelope.Decode(body)
	if err != nil {
		t.Fatalf("Decode(Encode(e)) = %v\nbody %s", err, body)
	}
	if want := normalized(t, e); !reflect.DeepEqual(got, want) {
		t.Fatalf("round trip:\n got %#v\nwant %#v", got, want)
	}
	again, err := got.Encode()
	if err != nil || !bytes.Equal(again, body) {
		t.Fatalf("re-encode differs (%v):\n%s\n%s", err, body, again)
	}
	var generic any // any JSON reader gets the same document
	if err := json.Unmarshal(body, &generic); err != nil {
		t.Fatalf("generic decode: %v", err)
	}
}

func depth(b []byte) int {
	d, max, inStr := 0, 0, false
	for i := 0; i < len(b); i++ {
		switch c := b[i]; {
		case inStr && c == '\\':
			i++
		case c == '"':
			inStr = !inStr
		case !inStr && (c == '{' || c == '['):
			d++
			if d > max {
				max = d
			}
		case !inStr && (c == '}' || c == ']'):
			d--
		}
	}
	return max
}

// pick returns a random element.
func pick[T any](r *rand.Rand, xs ...T) T { return xs[r.IntN(len(xs))] }

// mostly returns one of good 9 times in 10, else one of the others (edge
// and invalid values), so most generated envelopes are valid but every
// limit is crossed often.
func mostly[T any](r *rand.Rand, good []T, others ...T) T {
	if len(others) == 0 || r.IntN(10) != 0 {
		return pick(r, good...)
	}
	return pick(r, others...)
}

// randomPayload returns JSON (mostly valid, some at or past the limits).
func randomPayload(r *rand.Rand, depth int) string {
	if depth > envelope.MaxPayloadDepth+1 || r.IntN(4) == 0 {
		return pick(r, `0`, `-1.5e3`, `true`, `null`, `"x"`, `"\u00e9\u6771"`, `"<&>"`, `"\ud83d\ude00"`, `"\ud800"`,
			`"\u0000"`, "\"\xff\"", `"line\nbreak"`, `""`, "\"\u2028\"", `1e400`, `"a\"b"`)
	}
	n := r.IntN(3)
	if r.IntN(2) == 0 {
		parts := make([]string, n)
		for i := range parts {
			parts[i] = randomPayload(r, depth+1)
		}
		return "[" + strings.Join(parts, ",") + "]"
	}
	parts := make([]string, n)
	for i := range parts {
		parts[i] = pick(r, `"a"`, `"b"`, `"A"`, `"\u0061"`, `"é"`, `"<"`) + ":" + randomPayload(r, depth+1)
	}
	return "{" + strings.Join(parts, ",") + "}"
}

func randomEnvelope(r *rand.Rand) envelope.Envelope {
	times := []time.Time{time.Now(), time.Date(1, 1, 1, 0, 0, 1, 0, time.UTC), time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC),
		time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(300000, 6, 1, 0, 0, 0, 0, time.UTC), time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(9999, 12, 31, 23, 0, 0, 1, time.FixedZone("x", -3*3600)), time.Time{}}
	return envelope.Envelope{
		ID:            mostly(r, []string{"0190f3a4-7c1e-7b2a-9f00-1234567890ab", "0190F3A4-7C1E-7B2A-9F00-1234567890AB"}, "", "x"),
		Type:          mostly(r, []string{"order.created", "a:b/c_d-e", strings.Repeat("t", 256)}, "with space", strings.Repeat("t", 257)),
		OccurredAt:    mostly(r, times[:3], times[3:]...),
		AggregateType: mostly(r, []string{"order"}, "ä"),
		AggregateID:   mostly(r, []string{"o-1", `<a&b>"\`, strings.Repeat("z", 128)}, "o 1", "\u2028"),
		Sequence:      mostly(r, []int64{0, 1, 1 << 62}, -1),
		TenantID:      mostly(r, []string{"", "acme", "m\u00fcller", "\u2028"}, "a\tb", "\xff"),
		CorrelationID: mostly(r, []string{"", "c-1", "<&>"}, "a b"),
		SchemaVersion: mostly(r, []int{1, 2, 1<<31 - 1}, 1<<31, 0),
		Payload:       json.RawMessage(mostly(r, []string{randomPayload(r, 0), `{}`, " [ 1 , 2 ] ", strings.Repeat("[", 32) + strings.Repeat("]", 32)}, "null", strings.Repeat("[", 33)+strings.Repeat("]", 33))),
	}
}

// The round-trip property over generated envelopes, many at or past a
// limit: whatever Validate accepts, Decode reads back unchanged.
func TestRoundTripProperty(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(1, 2))
	accepted := 0
	const n = 20000
	for i := 0; i < n; i++ {
		e := randomEnvelope(r)
		if err := e.Validate(); err != nil {
			if !envelope.IsValidation(err) {
				t.Fatalf("Validate error is not a *ValidationError: %v", err)
			}
			continue
		}
		accepted++
		assertRoundTrip(t, e)
	}
	if accepted < n/20 {
		t.Fatalf("only %d of %d generated envelopes were valid: the property is barely exercised", accepted, n)
	}
	t.Logf("%d of %d generated envelopes valid; each round-tripped", accepted, n)
}

// FuzzRoundTrip fuzzes the same property (make fuzz runs it).
func FuzzRoundTrip(f *testing.F) {
	f.Add("0190f3a4-7c1e-7b2a-9f00-1234567890ab", "order.created", int64(1_700_000_000), int64(5), "order", "o-1", int64(3), "acme", "", 1, []byte(`{"a":[1,"<&>"]}`))
	f.Add("0190f3a4-7c1e-7b2a-9f00-1234567890ab", "t", int64(1_700_000_000), int64(0), "a", "b", int64(0), "", "", 1, []byte(`null`))
	f.Add("0190f3a4-7c1e-7b2a-9f00-1234567890ab", "t", int64(9_404_250_000_000), int64(0), "a", "b", int64(0), "", "", 1, []byte(`{}`)) // year 300000
	f.Add("0190f3a4-7c1e-7b2a-9f00-1234567890ab", "t", int64(0), int64(0), "a", "b", int64(0), "", "", 1, []byte("{\"a\":\"\xff\"}"))
	f.Add("0190f3a4-7c1e-7b2a-9f00-1234567890ab", "t", int64(0), int64(0), "a", "b", int64(0), "", "", 1, []byte(strings.Repeat("[", 9999)+strings.Repeat("]", 9999)))
	f.Add("0190f3a4-7c1e-7b2a-9f00-1234567890ab", "t", int64(0), int64(0), "a", "b", int64(0), "", "", 1, []byte(`{"a":1,"a":2}`))
	f.Fuzz(func(t *testing.T, id, typ string, sec, nsec int64, aggType, aggID string, seq int64, tenant, corr string, schema int, payload []byte) {
		e := envelope.Envelope{ID: id, Type: typ, OccurredAt: time.Unix(sec, nsec), AggregateType: aggType, AggregateID: aggID,
			Sequence: seq, TenantID: tenant, CorrelationID: corr, SchemaVersion: schema, Payload: payload}
		if err := e.Validate(); err != nil {
			if !envelope.IsValidation(err) {
				t.Fatalf("Validate error is not a *ValidationError: %v", err)
			}
			return
		}
		assertRoundTrip(t, e)
	})
}

// Decode is strict where JSON readers disagree: exact member names, no
// duplicates, UTF-8, so every consumer reads a message the same way.
func TestDecodeIsStrict(t *testing.T) {
	t.Parallel()
	good, _ := valid().Encode()
	g := string(good)
	cases := []struct {
		name, body, field string
	}{
		{"duplicate member", strings.Replace(g, `"type":"order.created"`, `"type":"order.created","type":"order.paid"`, 1), "type"},
		{"member differing only in case", strings.Replace(g, `"id":`, `"ID":`, 1), "id"},
		{"case variant beside the member", strings.Replace(g, `"type":"order.created"`, `"type":"order.created","Type":"order.paid"`, 1), "type"},
		{"duplicate unknown member", strings.Replace(g, `{"v":1,`, `{"v":1,"x":1,"x":2,`, 1), "envelope"},
		{"duplicate in the payload", strings.Replace(g, `"currency":"EUR"`, `"currency":"EUR","currency":"USD"`, 1), "payload"},
		{"invalid UTF-8", strings.Replace(g, `"acme"`, "\"ac\xffme\"", 1), "envelope"},
		{"trailing data", g + `{}`, "envelope"},
		{"payload too deep", strings.Replace(g, `{"amount_cents":1200,"currency":"EUR"}`, strings.Repeat("[", 33)+strings.Repeat("]", 33), 1), "payload"},
		{"year 10000", strings.Replace(g, `"2026-11-22T10:00:00.123456789Z"`, `"10000-01-01T00:00:00Z"`, 1), "occurred_at"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := envelope.Decode([]byte(tc.body))
			var ve *envelope.ValidationError
			if !errors.As(err, &ve) || ve.Field != tc.field {
				t.Fatalf("Decode = %v, want an error naming %q", err, tc.field)
			}
		})
	}
	// Unknown members are ignored (newer producers, older consumers).
	if _, err := envelope.Decode([]byte(strings.Replace(g, `{"v":1,`, `{"v":1,"added_later":{"x":[1]},`, 1))); err != nil {
		t.Fatalf("unknown member: %v", err)
	}
}

// envelope.New(..., nil) used to produce a JSON null payload that every
// consumer then rejected as missing.
func TestNewRefusesANullPayload(t *testing.T) {
	t.Parallel()
	for _, p := range []any{nil, map[string]int(nil), []int(nil)} {
		_, err := envelope.New("t", "a", "b", p)
		var ve *envelope.ValidationError
		if !errors.As(err, &ve) || ve.Field != "payload" || !errors.Is(err, envelope.ErrMissing) {
			t.Fatalf("New(%#v) = %v, want payload missing", p, err)
		}
	}
	if _, err := envelope.New("t", "a", "b", struct{}{}); err != nil {
		t.Fatal(err)
	}
}
