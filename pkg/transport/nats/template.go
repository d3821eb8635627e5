package nats

import (
	"fmt"
	"strconv"
	"strings"
	"unicode"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// Template fields, written {name} in a subject or header template.
var templateFields = map[string]func(m *outbox.Message) string{
	"event_id":       func(m *outbox.Message) string { return m.EventID },
	"event_type":     func(m *outbox.Message) string { return m.EventType },
	"aggregate_type": func(m *outbox.Message) string { return m.AggregateType },
	"aggregate_id":   func(m *outbox.Message) string { return m.GroupID },
	"sequence":       func(m *outbox.Message) string { return strconv.FormatInt(m.Sequence, 10) },
	"tenant_id":      func(m *outbox.Message) string { return m.Attributes[envelope.AttrTenantID] },
	"traceparent":    func(m *outbox.Message) string { return m.Attributes[envelope.AttrTraceparent] },
}

func fieldNames() string {
	return "{event_id} {event_type} {aggregate_type} {aggregate_id} {sequence} {tenant_id} {traceparent}"
}

// template is a parsed subject or header template: literal text and {field}
// references.
type template struct {
	parts []templatePart
}

type templatePart struct {
	lit   string
	field func(m *outbox.Message) string
}

// parseTemplate parses s, e.g. "{aggregate_type}.{event_type}".
func parseTemplate(s string) (template, error) {
	var t template
	for len(s) > 0 {
		i := strings.IndexByte(s, '{')
		if i < 0 {
			if strings.IndexByte(s, '}') >= 0 {
				return template{}, fmt.Errorf("unmatched '}' in %q", s)
			}
			t.parts = append(t.parts, templatePart{lit: s})
			break
		}
		if i > 0 {
			if strings.IndexByte(s[:i], '}') >= 0 {
				return template{}, fmt.Errorf("unmatched '}' in %q", s)
			}
			t.parts = append(t.parts, templatePart{lit: s[:i]})
		}
		j := strings.IndexByte(s[i:], '}')
		if j < 0 {
			return template{}, fmt.Errorf("unclosed '{' in %q", s)
		}
		name := s[i+1 : i+j]
		f, ok := templateFields[name]
		if !ok {
			return template{}, fmt.Errorf("unknown field {%s}: use one of %s", name, fieldNames())
		}
		t.parts = append(t.parts, templatePart{field: f})
		s = s[i+j+1:]
	}
	return t, nil
}

// render fills the template from m, passing each field's value through
// clean (literal text is kept as written).
func (t template) render(m *outbox.Message, clean func(string) string) string {
	var b strings.Builder
	for _, p := range t.parts {
		if p.field != nil {
			b.WriteString(clean(p.field(m)))
		} else {
			b.WriteString(p.lit)
		}
	}
	return b.String()
}

// single reports whether the template is one field alone (a header whose
// value may be empty, and is then left out).
func (t template) single() bool { return len(t.parts) == 1 && t.parts[0].field != nil }

// SanitizeToken makes s usable inside one subject token: NATS splits
// subjects on '.', treats '*' and '>' as wildcards and forbids whitespace, so
// each of those (and control characters) becomes '_'; an empty value becomes
// "_" so that the subject keeps its number of tokens. Event types such as
// "order.paid" therefore publish as "order_paid": write filters that way.
func SanitizeToken(s string) string {
	if s == "" {
		return "_"
	}
	clean := true
	for _, r := range s {
		if tokenBreaker(r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	return strings.Map(func(r rune) rune {
		if tokenBreaker(r) {
			return '_'
		}
		return r
	}, s)
}

func tokenBreaker(r rune) bool {
	return r == '.' || r == '*' || r == '>' || unicode.IsSpace(r) || unicode.IsControl(r) || r == unicode.ReplacementChar
}

// headerValue keeps a header value on one line (NATS headers are MIME-style).
func headerValue(s string) string {
	if !strings.ContainsAny(s, "\r\n") {
		return s
	}
	return strings.NewReplacer("\r", " ", "\n", " ").Replace(s)
}
