package wire

import (
	"bytes"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/tidwall/gjson"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// kind is a field's JSON type.
type kind int

const (
	kindString kind = iota // a JSON string
	kindInt                // a JSON number
	kindRaw                // JSON as stored (the payload or part of it)
)

// field is one value a template can name.
type field struct {
	name string
	kind kind
	// body: the value is read from the encoded envelope (the message's
	// columns do not carry it), which costs a decode per message.
	body bool
	str  func(e *event) string
	num  func(e *event) int64
}

// fields are the event fields templates name, besides payload.<path>.
var fields = map[string]*field{
	"event_id":       {name: "event_id", str: func(e *event) string { return e.eventID() }},
	"event_type":     {name: "event_type", str: func(e *event) string { return e.m.EventType }},
	"aggregate_type": {name: "aggregate_type", str: func(e *event) string { return e.m.AggregateType }},
	"aggregate_id":   {name: "aggregate_id", str: func(e *event) string { return e.m.GroupID }},
	"tenant_id":      {name: "tenant_id", str: func(e *event) string { return e.m.Attributes[envelope.AttrTenantID] }},
	"traceparent":    {name: "traceparent", str: func(e *event) string { return e.m.Attributes[envelope.AttrTraceparent] }},
	"occurred_at":    {name: "occurred_at", body: true, str: func(e *event) string { return e.env.OccurredAt }},
	"correlation_id": {name: "correlation_id", body: true, str: func(e *event) string { return e.env.CorrelationID }},
	"causation_id":   {name: "causation_id", body: true, str: func(e *event) string { return e.env.CausationID }},
	"tracestate":     {name: "tracestate", body: true, str: func(e *event) string { return e.env.TraceState }},
	"sequence":       {name: "sequence", kind: kindInt, num: func(e *event) int64 { return e.m.Sequence }},
	"schema_version": {name: "schema_version", kind: kindInt, body: true, num: func(e *event) int64 { return int64(e.env.SchemaVersion) }},
	// publish_attempt counts publish attempts including this one (1 on the
	// first); publish_retries the failed ones before it (0 on the first),
	// which is what a "retry count" column records when the publish succeeds.
	"publish_attempt":     {name: "publish_attempt", kind: kindInt, num: func(e *event) int64 { return int64(max(e.m.Attempt, 1)) }},
	"publish_retries":     {name: "publish_retries", kind: kindInt, num: func(e *event) int64 { return int64(max(e.m.Attempt-1, 0)) }},
	"occurred_at_unix":    {name: "occurred_at_unix", kind: kindInt, body: true, num: func(e *event) int64 { return e.occurred().Unix() }},
	"occurred_at_unix_ms": {name: "occurred_at_unix_ms", kind: kindInt, body: true, num: func(e *event) int64 { return e.occurred().UnixMilli() }},
	"payload":             {name: "payload", kind: kindRaw, body: true},
}

// fieldList names every field, for error messages.
func fieldList() string {
	names := make([]string, 0, len(fields)+1)
	for n := range fields {
		names = append(names, "{"+n+"}")
	}
	sort.Strings(names)
	return strings.Join(append(names, "{payload.<member>...}"), " ")
}

// ref is one field reference: a field, or a path into the payload.
type ref struct {
	f     *field
	path  []string // payload.<a>.<b>: members a then b of the payload
	gpath string   // path as a gjson path (each member escaped)
}

func (r ref) String() string {
	if r.path != nil {
		return "payload." + strings.Join(r.path, ".")
	}
	return r.f.name
}

func (r ref) kind() kind {
	if r.path != nil {
		return kindRaw
	}
	return r.f.kind
}

func (r ref) needsBody() bool { return r.path != nil || r.f.body }

// parseRef parses a field name as written between braces.
func parseRef(name string) (ref, error) {
	if rest, ok := strings.CutPrefix(name, "payload."); ok {
		path := strings.Split(rest, ".")
		for _, p := range path {
			if p == "" {
				return ref{}, fmt.Errorf("{%s}: an empty member name in the payload path", name)
			}
		}
		esc := make([]string, len(path))
		for i, p := range path {
			esc[i] = gjson.Escape(p)
		}
		return ref{f: fields["payload"], path: path, gpath: strings.Join(esc, ".")}, nil
	}
	f, ok := fields[name]
	if !ok {
		return ref{}, fmt.Errorf("unknown field {%s}: use one of %s", name, fieldList())
	}
	return ref{f: f}, nil
}

// event is one outbox message being rendered. Values that only the encoded
// envelope holds are read from it once, on first use, in one pass over its
// members (gjson: no allocation per member; the body was written by
// fifobox's Encode, so it is valid JSON).
type event struct {
	m       *outbox.Message
	idFmt   IDFormat
	id      string
	decoded bool
	env     envWire
	err     error
}

// envWire is the part of fifobox's envelope that outbox.Message's columns
// do not carry.
type envWire struct {
	OccurredAt    string
	CorrelationID string
	CausationID   string
	TraceState    string
	SchemaVersion int
	Payload       string // the payload's JSON, as stored
}

var errNotEnvelope = errors.New("wire: the stored body is not fifobox's envelope")

// decode reads the envelope body once.
func (e *event) decode() error {
	if e.decoded {
		return e.err
	}
	e.decoded = true
	doc := gjson.ParseBytes(e.m.Body)
	if !doc.IsObject() {
		e.err = errNotEnvelope
		return e.err
	}
	var payload, occurred bool
	doc.ForEach(func(k, v gjson.Result) bool {
		switch k.Str {
		case "occurred_at":
			e.env.OccurredAt, occurred = v.Str, true
		case "correlation_id":
			e.env.CorrelationID = v.Str
		case "causation_id":
			e.env.CausationID = v.Str
		case "tracestate":
			e.env.TraceState = v.Str
		case "schema_version":
			e.env.SchemaVersion = int(v.Int())
		case "payload":
			e.env.Payload, payload = v.Raw, true
		}
		return true
	})
	if !payload || !occurred {
		e.err = fmt.Errorf("%w: it has no payload or occurred_at", errNotEnvelope)
	}
	return e.err
}

func (e *event) eventID() string {
	if e.id == "" {
		e.id = e.idFmt.Format(e.m.EventID)
	}
	return e.id
}

func (e *event) occurred() time.Time {
	t, _ := time.Parse(time.RFC3339Nano, e.env.OccurredAt)
	return t
}

// raw returns the JSON value r names, or "" when it is absent or null.
func (e *event) raw(r ref) string {
	v := e.env.Payload
	if r.path != nil {
		v = gjson.Get(v, r.gpath).Raw
	}
	if v == "null" {
		return ""
	}
	return v
}

// value is a reference's value for one event: a string, a number or raw JSON.
type value struct {
	k   kind
	s   string
	n   int64
	raw string
}

func (v value) empty() bool {
	switch v.k {
	case kindString:
		return v.s == ""
	case kindRaw:
		return v.raw == ""
	}
	return false
}

// text is the value in a string context: a JSON string's content, a
// number's digits, other JSON as written.
func (v value) text() string {
	switch v.k {
	case kindString:
		return v.s
	case kindInt:
		return strconv.FormatInt(v.n, 10)
	}
	if len(v.raw) > 0 && v.raw[0] == '"' {
		return gjson.Parse(v.raw).Str
	}
	return v.raw
}

// appendJSON writes the value as JSON; an empty value is null.
func (v value) appendJSON(dst []byte) []byte {
	switch {
	case v.empty():
		return append(dst, "null"...)
	case v.k == kindString:
		return appendString(dst, v.s)
	case v.k == kindInt:
		return strconv.AppendInt(dst, v.n, 10)
	}
	return append(dst, v.raw...)
}

// get resolves r for e.
func (e *event) get(r ref) (value, error) {
	if r.needsBody() {
		if err := e.decode(); err != nil {
			return value{}, err
		}
	}
	switch r.kind() {
	case kindInt:
		return value{k: kindInt, n: r.f.num(e)}, nil
	case kindRaw:
		return value{k: kindRaw, raw: e.raw(r)}, nil
	}
	return value{k: kindString, s: r.f.str(e)}, nil
}

// appendString writes s as a JSON string without HTML escaping, as Go's
// encoder does with SetEscapeHTML(false).
func appendString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < 0x80 {
			continue
		}
		if c >= 0x80 {
			// Valid UTF-8 passes through except U+2028/U+2029, which Go escapes.
			if c == 0xE2 && i+2 < len(s) && s[i+1] == 0x80 && (s[i+2] == 0xA8 || s[i+2] == 0xA9) {
				dst = append(dst, s[start:i]...)
				dst = append(dst, `\u202`...)
				dst = append(dst, "89"[s[i+2]-0xA8])
				i += 2
				start = i + 1
			}
			continue
		}
		dst = append(dst, s[start:i]...)
		switch c {
		case '"', '\\':
			dst = append(dst, '\\', c)
		case '\n':
			dst = append(dst, `\n`...)
		case '\r':
			dst = append(dst, `\r`...)
		case '\t':
			dst = append(dst, `\t`...)
		default:
			dst = append(dst, `\u00`...)
			dst = append(dst, "0123456789abcdef"[c>>4], "0123456789abcdef"[c&0xF])
		}
		start = i + 1
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}

func isNull(b []byte) bool { return len(b) == 0 || bytes.Equal(b, []byte("null")) }
