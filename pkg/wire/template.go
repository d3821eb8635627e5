package wire

import (
	"fmt"
	"strings"
)

// template is a parsed string template: literal text and {field}
// references. "{a|b}" is the first non-empty of a and b.
type template struct {
	parts []part
	// optional: the template was exactly "{field?}".
	optional bool
}

type part struct {
	lit  string
	alts []ref // one or more alternatives
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
			t.parts = append(t.parts, part{lit: s})
			break
		}
		if i > 0 {
			if strings.IndexByte(s[:i], '}') >= 0 {
				return template{}, fmt.Errorf("unmatched '}' in %q", s)
			}
			t.parts = append(t.parts, part{lit: s[:i]})
		}
		j := strings.IndexByte(s[i:], '}')
		if j < 0 {
			return template{}, fmt.Errorf("unclosed '{' in %q", s)
		}
		inner := s[i+1 : i+j]
		s = s[i+j+1:]
		if name, ok := strings.CutSuffix(inner, "?"); ok {
			if len(t.parts) > 0 || s != "" {
				return template{}, fmt.Errorf("{%s}: '?' (leave out when empty) applies to a whole value only", inner)
			}
			t.optional = true
			inner = name
		}
		var p part
		for _, name := range strings.Split(inner, "|") {
			r, err := parseRef(strings.TrimSpace(name))
			if err != nil {
				return template{}, err
			}
			p.alts = append(p.alts, r)
		}
		t.parts = append(t.parts, p)
	}
	return t, nil
}

// single returns the template's one reference part when the template is
// exactly one field (its value keeps the field's type).
func (t template) single() (part, bool) {
	if len(t.parts) == 1 && t.parts[0].alts != nil {
		return t.parts[0], true
	}
	return part{}, false
}

// refs lists every reference in the template.
func (t template) refs() []ref {
	var out []ref
	for _, p := range t.parts {
		out = append(out, p.alts...)
	}
	return out
}

// resolve returns the part's first non-empty alternative (or the last, empty).
func (p part) resolve(e *event) (value, error) {
	var v value
	for _, r := range p.alts {
		var err error
		if v, err = e.get(r); err != nil {
			return value{}, err
		}
		if !v.empty() {
			return v, nil
		}
	}
	return v, nil
}

// render fills the template from e as text.
func (t template) render(e *event) (string, error) {
	if len(t.parts) == 1 {
		p := t.parts[0]
		if p.alts == nil {
			return p.lit, nil
		}
		v, err := p.resolve(e)
		if err != nil {
			return "", err
		}
		return v.text(), nil
	}
	var b strings.Builder
	for _, p := range t.parts {
		if p.alts == nil {
			b.WriteString(p.lit)
			continue
		}
		v, err := p.resolve(e)
		if err != nil {
			return "", err
		}
		b.WriteString(v.text())
	}
	return b.String(), nil
}

// isSet reports whether the template was given (a zero template renders "").
func (t template) isSet() bool { return len(t.parts) > 0 }
