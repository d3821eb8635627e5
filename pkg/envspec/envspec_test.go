package envspec_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/envspec"
)

func TestGetReadsOnlyDeclaredVariables(t *testing.T) {
	s := envspec.Set{{Name: "FIFOBOX_TEST_A", Required: true}}
	t.Setenv("FIFOBOX_TEST_A", "a")
	t.Setenv("FIFOBOX_TEST_B", "b")
	if got := s.Get("FIFOBOX_TEST_A"); got != "a" {
		t.Errorf("Get(FIFOBOX_TEST_A) = %q", got)
	}
	defer func() {
		r := recover()
		if r == nil || !strings.Contains(r.(string), "FIFOBOX_TEST_B") {
			t.Errorf("Get of an undeclared variable: recovered %v, want a panic naming it", r)
		}
	}()
	s.Get("FIFOBOX_TEST_B")
}

func TestJoinKeepsTheFirstDeclaration(t *testing.T) {
	a := envspec.Set{{Name: "X", Required: true}, {Name: "Y"}}
	b := envspec.Set{{Name: "X"}, {Name: "Z", Reserved: true}}
	j := envspec.Join(a, b)
	if !slices.Equal(j.Names(), []string{"X", "Y", "Z"}) {
		t.Errorf("Join names %v", j.Names())
	}
	if x, _ := j.Lookup("X"); !x.Required {
		t.Errorf("X lost its first declaration: %+v", x)
	}
	if _, ok := j.Lookup("W"); ok {
		t.Errorf("Lookup found an undeclared name")
	}
}
